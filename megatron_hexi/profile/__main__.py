from megatron_hexi.profile.cli import cli

cli()
