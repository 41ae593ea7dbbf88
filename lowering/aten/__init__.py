"""Lowerings written in aten ops, for the shapes no kernel of ``triton/`` serves: they run on every
device, and Inductor compiles them like model code."""
