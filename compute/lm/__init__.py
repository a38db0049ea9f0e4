"""Loading a causal LM, choosing its device and dtype, sampling from it, the verifiable tasks
it is trained on, and naming its parameters by layer x module."""
