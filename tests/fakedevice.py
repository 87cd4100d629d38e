"""A CUDA stand-in on the CPU that enforces CUDA's placement rules.

`with fake_cuda():` makes torch.cuda look available; every tensor created on or moved to "cuda"
really lives on the CPU but is tagged "cuda" (by its storage, so views, `.data` and in-place
results stay tagged), reports `device == cuda:0`, and every op's output is tagged when an input
is. An op that mixes a tagged tensor with an untagged CPU tensor raises CUDA's "Expected all
tensors to be on the same device"; as on CUDA, a 0-dim CPU tensor may join a pointwise op, and
copies, indexing with CPU indices and `.item()` cross freely. `.numpy()` of a tagged tensor
raises as CUDA's does; a generator made for "cuda" must meet tagged tensors only; the device's
own generator state (torch.cuda.get/set_rng_state) is kept, and naming a second device raises.
CUDA autocast is CPU autocast (`torch.autocast("cuda")`, `torch.is_autocast_enabled("cuda")` and
`torch.get_autocast_dtype("cuda")` act on the CPU's state, where the kernels really run), so a
model casting to autocast's dtype by hand meets kernels that autocast too. Kernels, NCCL, streams,
CUDA's own autocast op lists and memory are not modelled.

What would make the host wait for the device is counted in `tags.syncs` (one line per sync: the
op and our innermost calling line): a value read from a device tensor (`.item()`, `float()`,
`bool()`, `if t > 0`, `.tolist()`), a copy to the host, an op whose output size depends on the
values (nonzero, boolean-mask indexing, unique, masked_select, repeat_interleave without
output_size), torch.equal / allclose and torch.cuda.synchronize.
"""
from __future__ import annotations

import contextlib
import sys
import traceback
from pathlib import Path
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CUDA = torch.device("cuda", 0)
aten = torch.ops.aten
_DEVICE, _IS_CUDA = torch._C.TensorBase.__dict__["device"], torch._C.TensorBase.__dict__["is_cuda"]
# Ops CUDA runs across devices (copies, CPU indices into a CUDA tensor, storage swaps).
_CROSSING = {aten._to_copy.default, aten.copy_.default, aten.set_.source_Tensor, aten.index.Tensor,
             aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default,
             aten._local_scalar_dense.default, aten.lift_fresh.default, aten.detach.default}

# Ops whose result the host needs before it can go on (on CUDA: a device-to-host wait).
_SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten._unique2.default, aten.unique_dim.default,
            aten.unique_consecutive.default, aten.masked_select.default, aten.repeat_interleave.Tensor,
            aten.equal.default, aten.allclose.default}
_ROOT = Path(__file__).resolve().parents[1]


def _caller() -> str:
    """The innermost line of this repository (not this file) on the stack: where a sync was asked for."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename)
        if path.is_relative_to(_ROOT) and path.name != "fakedevice.py" and ".venv" not in path.parts:
            return f"{path.relative_to(_ROOT)}:{frame.lineno} {frame.line}"
    return "?"


class _Tags:
    """data_ptr of a tagged storage -> one tensor holding it (kept alive, so a freed CUDA
    address is never reused by a CPU tensor and read as tagged)."""

    def __init__(self):
        self.held: dict = {}
        self.gens: dict[int, torch.Generator] = {}  # id -> generator made for "cuda"
        self.syncs: list[str] = []  # "<what>: <our innermost line>", one per device-to-host wait

    def sync(self, what: str):
        self.syncs.append(f"{what}: {_caller()}")

    @staticmethod
    def _ptr(t: torch.Tensor):
        with torch._C.DisableTorchFunction():  # the real device, also when called outside the modes
            return _Tags._real_ptr(t)

    @staticmethod
    def _real_ptr(t: torch.Tensor):
        if t.is_meta or t.layout != torch.strided or t.device.type != "cpu":
            return 0
        # Empty tensors share address 0: those are told apart by the object (held, so ids stay unique).
        return t.untyped_storage().data_ptr() or ("empty", id(t))

    def has(self, t) -> bool:
        return isinstance(t, torch.Tensor) and self._ptr(t) in self.held

    def add(self, out):
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (p := self._ptr(t)):
                self.held[p] = t

    def drop(self, out):
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.held.pop(self._ptr(t), None)


def _from_torch() -> bool:
    """Is the caller PyTorch itself? Its internals group tensors by the real (CPU) device and move
    results `.to()` it (clip_grad_norm_, foreach optimizers): those moves keep the tag."""
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return caller == "torch" or caller.startswith("torch.")


def _is_cuda(dev) -> bool:
    return dev is not None and not isinstance(dev, (int, torch.dtype)) and torch.device(dev).type == "cuda"


def _is_cpu(dev) -> bool:
    return isinstance(dev, (str, torch.device)) and torch.device(dev).type == "cpu"


class _Dispatch(TorchDispatchMode):
    """Propagates tags through every aten op (autograd's backward and the optimizers included)."""

    def __init__(self, tags: _Tags):
        super().__init__()
        self.tags = tags

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunction():
            # DDP's C++ reducer writes gradients into bucket views it allocated without a device
            # (here: untagged); an `out=` buffer takes the tag of the inputs instead of being checked.
            outs = [a for a in tree_flatten(kwargs.get("out"))[0] if isinstance(a, torch.Tensor)]
            if outs and any(self.tags.has(a) for a in tree_flatten(args)[0]):
                self.tags.add(outs)
            tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            tagged = any(self.tags.has(t) for t in tensors)
            if tagged and (func in _SYNCING or (func is aten.index.Tensor and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]))):
                self.tags.sync(str(func))
            if tagged and func not in _CROSSING:
                pointwise = torch.Tag.pointwise in func.tags
                for t in tensors:
                    if (not self.tags.has(t) and t.device.type == "cpu" and t.numel() > 0
                            and not (pointwise and t.dim() == 0)):
                        raise RuntimeError(
                            "Expected all tensors to be on the same device, but found at least two devices, "
                            f"cuda:0 and cpu! (fakedevice: {func}, cpu tensor of shape {tuple(t.shape)})")
            out = func(*args, **kwargs)
            if tagged and func is not aten._local_scalar_dense.default:
                self.tags.add(out)
        return out


class _Function(TorchFunctionMode):
    """Routes device="cuda" requests to the CPU and tags what they return."""

    def __init__(self, tags: _Tags):
        super().__init__()
        self.tags = tags

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        owner = getattr(func, "__self__", None)
        if owner is _DEVICE:
            return CUDA if self.tags.has(args[0]) else func(*args)
        if owner is _IS_CUDA:
            return self.tags.has(args[0])
        if func is torch.Tensor.numpy and self.tags.has(args[0]):
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the "
                            "tensor to host memory first.")
        if func in (torch.Tensor.pin_memory,):
            return args[0]
        if func is torch.Tensor.cuda:
            return self._move(args[0], True, (), {k: v for k, v in kwargs.items() if k == "non_blocking"})
        if func is torch.Tensor.tolist and self.tags.has(args[0]):
            self.tags.sync("tolist")
        if func is torch.Tensor.cpu:
            return self._move(args[0], False, (), {})
        if func is torch.Tensor.to:
            rest, dev = list(args[1:]), kwargs.pop("device", None)
            if rest and isinstance(rest[0], (str, torch.device)):
                dev = rest.pop(0)
            elif rest and isinstance(rest[0], torch.Tensor):
                other = rest.pop(0)
                dev, rest = (CUDA if self.tags.has(other) else "cpu"), [other.dtype, *rest]
            if _is_cuda(dev) or (_is_cpu(dev) and self.tags.has(args[0]) and not _from_torch()):
                return self._move(args[0], _is_cuda(dev), rest, kwargs)
            return func(*args[:1], *([dev] if dev is not None else []), *rest, **kwargs)
        if isinstance(kwargs.get("generator"), torch.Generator):
            self._check_generator(func, kwargs["generator"], args)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
            out = func(*args, **kwargs)
            if name not in ("Generator",):
                self.tags.add(out)
            return out
        if _is_cuda(kwargs.get("map_location")):
            kwargs["map_location"] = "cpu"
        return func(*args, **kwargs)

    def _check_generator(self, func, g, args):
        # Dispatch sees a new wrapper of the generator, so the check is made here, on the caller's object.
        tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        on_cuda, tagged = id(g) in self.tags.gens, any(self.tags.has(t) for t in tensors)
        if tensors and on_cuda != tagged:
            raise RuntimeError(f"Expected a '{'cuda' if tagged else 'cpu'}' device type for generator but found "
                               f"'{'cuda' if on_cuda else 'cpu'}' (fakedevice: {getattr(func, '__name__', func)})")

    def _move(self, t, to_cuda: bool, rest, kwargs):
        if to_cuda == self.tags.has(t):
            return t.to(*rest, **kwargs)
        kwargs.pop("copy", None)
        if not to_cuda:
            self.tags.sync("copy to the host")
        out = t.to("cpu", *rest, copy=True, **kwargs)
        (self.tags.add if to_cuda else self.tags.drop)(out)
        return out


def _cuda_rng(count: int = 1) -> list:
    """torch.cuda's get/set_rng_state(_all) over `count` devices' generators (CPU generators here):
    a device index past the last raises IndexError, as CUDA's default_generators[idx] does."""
    gens = [torch.Generator().manual_seed(i) for i in range(count)]

    def gen(device="cuda") -> torch.Generator:
        idx = torch.device("cuda", device).index if isinstance(device, int) else torch.device(device).index
        return gens[0 if idx is None else idx]  # index None: the current device, 0

    def set_state(new_state, device="cuda"):
        gen(device).set_state(new_state)

    def set_all(states):
        for i, state in enumerate(states):
            set_state(state, i)

    funcs = dict(get_rng_state=lambda device="cuda": gen(device).get_state(), set_rng_state=set_state,
                 get_rng_state_all=lambda: [g.get_state() for g in gens], set_rng_state_all=set_all)
    return [mock.patch(f"{where}.{name}", f) for where in ("torch.cuda", "torch.cuda.random") for name, f in funcs.items()]


def _generator_class(tags: _Tags):
    class Generator(torch.Generator):
        """torch.Generator(device="cuda") -> a CPU generator remembered as a CUDA one."""

        def __new__(cls, device="cpu"):
            g = super().__new__(cls, "cpu" if _is_cuda(device) else device)
            if _is_cuda(device):
                tags.gens[id(g)] = g
            return g

        def __init__(self, device="cpu"):
            pass

        @property
        def device(self):
            return CUDA if id(self) in tags.gens else super().device

    return Generator


class _CPUAutocast(torch.amp.autocast):
    def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        super().__init__("cpu" if device_type == "cuda" else device_type, dtype, enabled, cache_enabled)


def _autocast_patches() -> list:
    """CUDA's autocast state read and set as the CPU's (the stand-in's tensors live there)."""
    on, dtype = torch.is_autocast_enabled, torch.get_autocast_dtype
    cpu = lambda d: "cpu" if d in (None, "cuda") else d  # noqa: E731  (no argument: CUDA's, as torch reads it)
    return [mock.patch("torch.autocast", _CPUAutocast),
            mock.patch("torch.is_autocast_enabled", lambda device_type=None: on(cpu(device_type))),
            mock.patch("torch.get_autocast_dtype", lambda device_type: dtype(cpu(device_type)))]


@contextlib.contextmanager
def fake_cuda():
    """torch.cuda "available" with one device; tensors placed on it checked as CUDA would."""
    tags = _Tags()
    patches = [mock.patch("torch.cuda.is_available", lambda: True),
               mock.patch("torch.cuda.device_count", lambda: 1),
               mock.patch("torch.Generator", _generator_class(tags)),
               mock.patch("torch.cuda.set_device", lambda d: None),
               mock.patch("torch.cuda.current_device", lambda: 0),
               mock.patch("torch.cuda.synchronize", lambda d=None: tags.sync("torch.cuda.synchronize")),
               mock.patch("torch.cuda.get_device_name", lambda d=None: "fakedevice"),
               mock.patch("torch.cuda.get_device_properties", lambda d=None: mock.Mock(
                   name="fakedevice", total_memory=2**30, L2_cache_size=2**20, major=9, minor=0,
                   multi_processor_count=1)),
               mock.patch("torch.cuda.is_bf16_supported", lambda *a, **k: True),
               mock.patch("torch.cuda.empty_cache", lambda: None),
               mock.patch("torch.cuda.reset_peak_memory_stats", lambda d=None: None),
               mock.patch("torch.cuda.memory_allocated", lambda d=None: 0),
               mock.patch("torch.cuda.max_memory_allocated", lambda d=None: 0),
               # The optimizers ask the current CUDA stream whether a graph is being captured.
               mock.patch("torch.accelerator.current_stream", lambda d=None: mock.Mock(is_capturing=lambda: False)),
               *_cuda_rng(), *_autocast_patches()]
    # Device tensors our code caches (made once per device) were tagged by an earlier context
    # and are plain CPU tensors now: made again in this one, as a fresh process would.
    from laplace.data.crop_augment import _channel_constants

    _channel_constants.cache_clear()
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(_Function(tags))
        stack.enter_context(_Dispatch(tags))
        yield tags
    tags.held.clear()
    tags.gens.clear()
