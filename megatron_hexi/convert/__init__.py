"""Model conversion: Hugging Face families <-> megatron-hexi checkpoints (`hexi-convert`)."""
