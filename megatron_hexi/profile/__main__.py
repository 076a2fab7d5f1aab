import sys

from megatron_hexi.profile.cli import main

sys.exit(main())
