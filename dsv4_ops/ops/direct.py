"""``dsv4.<op>(...)``: how the model's layers and the public wrappers call the ``torch.ops.dsv4`` ops.

The dispatcher's Python layers between ``torch.ops.dsv4.<op>`` and the op's body (custom_op's backend wrapper, a
dynamo-disable frame, triton_op's ``wrap_triton`` switch, the aliasing check; outside inference mode the autograd and
ADInplaceOrView kernels too) cost 6-19 µs a call on the H100 box, as much as a small op's launch. They matter only
where something watches the call: torch.compile or export tracing, a dispatch or function mode, functorch, tensor
subclasses, autograd recording; there the call is the registered op. A plain eager call runs the body the dispatcher
would reach and bumps each mutated argument's version counter once, as ADInplaceOrView does, whatever the body
(a Triton kernel or in-place aten ops) does inside.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch._library.custom_ops import OPDEFS


_PLAIN = (Tensor, torch.nn.Parameter)  # a Parameter dispatches as a plain tensor (its __torch_function__ is off)
_VALUES = (int, float, bool, str, type(None))


def _watched(args: tuple) -> bool:
    if (torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack()
            or torch._C._are_functorch_transforms_active()):
        return True
    grad = torch.is_grad_enabled()
    for a in args:
        if type(a) in _PLAIN:
            if grad and a.requires_grad:
                return True
        elif type(a) not in _VALUES:  # a tensor subclass, an FX proxy, a SymInt
            return True
    return False


class DirectOp:
    __slots__ = ("op", "body", "mutated")

    def __init__(self, name: str):
        self.op = getattr(torch.ops.dsv4, name)
        self.body = OPDEFS[f"dsv4::{name}"]._init_fn  # the body with wrap_triton off, as the dispatcher runs it
        self.mutated = tuple(i for i, a in enumerate(self.op.default._schema.arguments)
                             if a.alias_info is not None and a.alias_info.is_write)

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling() or kwargs or _watched(args):
            return self.op(*args, **kwargs)
        if not self.mutated:
            return self.body(*args)
        torch._C._increment_version(tuple(args[i] for i in self.mutated if i < len(args) and args[i] is not None))
        with torch._C._AutoDispatchBelowADInplaceOrView():  # the body's own in-place aten ops bump nothing more
            return self.body(*args)


class DirectOps:
    """A :class:`DirectOp` per registered ``dsv4`` op, made once ``dsv4_ops.ops`` registered them all."""

    def add_registered(self) -> None:
        for qualname in list(OPDEFS):
            namespace, name = qualname.split("::")
            if namespace == "dsv4":
                setattr(self, name, DirectOp(name))


dsv4 = DirectOps()
