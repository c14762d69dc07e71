"""Every change this package makes to torch's or megatron-core's behaviour, one module per concern."""
