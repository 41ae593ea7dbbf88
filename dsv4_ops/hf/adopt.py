"""Make a transformers module run dsv4_ops code without copying its parameters.

``adopt(hf_module, ours)`` walks ``ours`` (a dsv4_ops module of the same architecture, built on
the meta device) and gives every HF submodule of the same name a class that derives from both
classes, ours first: our methods run, on HF's own ``Parameter`` objects. Because nothing is
copied, ``state_dict`` keys and tensors, ``save_pretrained``, ``model.to(...)`` and weights loaded
later all keep working; ``isinstance(module, HFClass)`` stays true. ``release`` undoes it
exactly: original classes, original attribute values, added buffers removed.
"""
from __future__ import annotations

from torch import nn

__all__ = ["adopt", "release", "is_adopted"]

_MODULE_INTERNALS = frozenset(nn.Module().__dict__)  # _parameters, _buffers, hooks, training, ...
# attributes HF's own code keeps reading while adopted (our code reads its config elsewhere)
_HF_OWNED = frozenset({"config"})
_MISSING = object()
_RECORD = "_dsv4_adopted"  # on each adopted module: (original class, {attr: original value or _MISSING})
_MIXED: dict[tuple[type, type], type] = {}


def _mixed_class(ours: type, theirs: type) -> type:
    key = (ours, theirs)
    if key not in _MIXED:
        _MIXED[key] = type(f"{ours.__name__}On{theirs.__name__}", (ours, theirs), {"__module__": __name__})
    return _MIXED[key]


def _check_same_tensors(hf_module: nn.Module, ours: nn.Module) -> None:
    theirs = {k: tuple(v.shape) for k, v in hf_module.state_dict().items()}
    mine = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    missing, extra = sorted(mine.keys() - theirs.keys()), sorted(theirs.keys() - mine.keys())
    if missing or extra:
        raise TypeError(f"dsv4_ops.hf: {type(hf_module).__name__} does not have the DeepSeek-V4 layout dsv4_ops "
                        f"expects: it lacks {missing[:5]} and has unexpected {extra[:5]}")
    shapes = [(k, theirs[k], mine[k]) for k in mine if theirs[k] != mine[k]]
    if shapes:
        k, t, m = shapes[0]
        raise TypeError(f"dsv4_ops.hf: {k} has shape {t}, the config implies {m}")


def adopt(hf_module: nn.Module, ours: nn.Module) -> None:
    """Turn ``hf_module`` (and each submodule ``ours`` has) into an instance of ``ours``' class.

    ``ours`` is built with its parameters on the meta device; buffers it has and HF lacks
    (non-persistent, derived from the config) must be real: they are registered on HF's module.
    """
    _check_same_tensors(hf_module, ours)
    for name, mine in ours.named_modules():
        target = hf_module.get_submodule(name) if name else hf_module
        if hasattr(target, _RECORD) or isinstance(target, type(mine)):
            continue  # already ours, or a plain layer both sides share (nn.Linear, nn.Embedding)
        saved: dict[str, object] = {}
        for attr, value in mine.__dict__.items():
            if attr in _MODULE_INTERNALS or attr in _HF_OWNED:
                continue
            saved[attr] = target.__dict__.get(attr, _MISSING)
            target.__dict__[attr] = value
        for leaf, value in mine._buffers.items():
            if leaf in target._buffers:
                continue
            if value is None or value.is_meta:
                raise RuntimeError(f"dsv4_ops.hf: the buffer {name}.{leaf} of the dsv4_ops module is not materialised")
            target.register_buffer(leaf, value, persistent=False)
            saved["buffer:" + leaf] = _MISSING
        target.__dict__[_RECORD] = (type(target), saved)
        target.__class__ = _mixed_class(type(mine), type(target))


def release(hf_module: nn.Module) -> None:
    """Undo ``adopt`` on ``hf_module`` and all its submodules."""
    for target in hf_module.modules():
        record = target.__dict__.pop(_RECORD, None)
        if record is None:
            continue
        cls, saved = record
        for attr, value in saved.items():
            if attr.startswith("buffer:"):
                target._buffers.pop(attr[len("buffer:"):], None)
                target._non_persistent_buffers_set.discard(attr[len("buffer:"):])
            elif value is _MISSING:
                target.__dict__.pop(attr, None)
            else:
                target.__dict__[attr] = value
        target.__class__ = cls


def is_adopted(module: nn.Module) -> bool:
    return _RECORD in module.__dict__
