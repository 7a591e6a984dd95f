"""Level-3 kernel tasks: one module per task (reference ``Model``, ``get_inputs``, ``get_init_inputs``) beside its CUDA solution (``<name>.cu``)."""
