"""Studies: the scaling model, its exact counts and the emulated cluster."""
