"""Cheaper launches of Triton kernels already compiled: `fast(kernel)[grid](*args, **kwargs)`.

Every `kernel[grid](...)` goes through Triton's JIT front end (argument binding, the specialization of
every argument, the cache-key hash, the global-variable check) and, for wrapped kernels, the autotuner's
and the heuristics' own dictionaries: tens of microseconds of Python a launch. The TwELL training op
issues ~16 launches a layer a step, and its eager forward is host-bound at 16k tokens (docs/RESULTS.md,
"Where the 1.5b step idles"), so that front end is GPU idle time.

`fast(kernel)` keeps, per call site, the compiled kernel each distinct call signature resolved to, keyed
by what decides Triton's choice, computed conservatively (never coarser than Triton's own key):
  - a tensor argument: its dtype and whether its address is 16-byte aligned; an int: whether it is 1,
    whether it is a multiple of 16 and its width (32 / 64 bits); a bool: its value; a float: nothing;
    a TMA descriptor: its dtype and block shape; a constexpr or launch option: its value;
  - an autotuned kernel: the values of the autotuner's key arguments (its choice for them is fixed once
    tuned); heuristics: the values they compute for this call.
A call whose key was seen launches the compiled kernel directly (after the chosen configuration's
pre-hook, where it has one). Any other call (first calls, the autotuner's timing of a new key, launch
hooks set by a profiler such as Proton, an argument of a type not listed above) takes Triton's own path,
which also records the key. Under the interpreter (TRITON_INTERPRET=1) every call takes Triton's path.

`set_fast_launch(False)` (or TWELL_FAST_LAUNCH=0 in the environment) sends every call through Triton's
front end: the same kernels, bit-identical results, for comparing the host cost.
"""

from __future__ import annotations

import inspect
import os

import torch
import triton

from ._common import interpreting

_enabled = {"on": os.environ.get("TWELL_FAST_LAUNCH", "1") not in ("0", "false", "False", "")}
_I32 = 1 << 31
_I64 = 1 << 63


def set_fast_launch(on: bool) -> None:
    """Launch through the kept compiled kernels (True, the default) or through Triton's front end."""
    _enabled["on"] = bool(on)


def fast_launch_enabled() -> bool:
    return _enabled["on"] and not interpreting()


def _hooked(hook) -> bool:
    """Whether a launch hook is set: None, or an empty HookChain (Triton 3.6: never None), is none."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or bool(calls)


class _Unkeyable(Exception):
    """An argument whose specialization this module does not model: the call takes Triton's path."""


def _arg_key(value):
    """The part of Triton's specialization a non-constexpr argument can decide (conservatively finer)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        width = 0 if -_I32 <= value < _I32 else (1 if -_I64 <= value < _I64 else 2)
        return value == 1, value % 16 == 0, width
    if isinstance(value, float):
        return float
    if value is None:
        return None
    block_shape = getattr(value, "block_shape", None)
    base = getattr(value, "base", None)
    if block_shape is not None and isinstance(base, torch.Tensor):  # a host-side TMA descriptor
        return "desc", base.dtype, tuple(block_shape), getattr(value, "padding", None)
    raise _Unkeyable(type(value).__name__)


def _layers(kernel):
    """(JITFunction, [wrappers outside-in]) of a JITFunction wrapped by autotune / heuristics, or
    (None, wrappers) when the innermost function is not a JITFunction (the interpreter's kernels)."""
    wrappers = []
    while isinstance(kernel, (triton.runtime.Autotuner, triton.runtime.Heuristics)):
        wrappers.append(kernel)
        kernel = kernel.fn
    return (kernel if isinstance(kernel, triton.runtime.JITFunction) else None), wrappers


class _Site:
    """A call signature's compiled kernel, the constexprs its wrappers added, and the chosen
    configuration's pre-hook with every keyword Triton gives it (options such as num_warps included)."""

    __slots__ = ("compiled", "extras", "pre_hook", "hook_extras")

    def __init__(self, compiled, extras: dict, pre_hook, hook_extras: dict):
        self.compiled, self.extras, self.pre_hook, self.hook_extras = compiled, extras, pre_hook, hook_extras


class FastKernel:
    """`fast(kernel)`: launched as `kernel[grid](*args, **kwargs)` is, with the compiled kernels kept."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._ready = False  # what the fast path needs is read from the kernel on its first use

    def _prepare(self) -> None:
        self.jit, self.wrappers = _layers(self.kernel)
        self._ready = True
        if self.jit is None:  # not a compiled kernel (the interpreter's): always Triton's path
            return
        self.names = list(self.jit.arg_names)
        self.constexpr = frozenset(p.name for p in self.jit.params if p.is_constexpr)
        self.defaults = {
            name: p.default
            for name, p in self.jit.signature.parameters.items()
            if p.default is not inspect.Parameter.empty
        }
        self._tuners = [w for w in self.wrappers if isinstance(w, triton.runtime.Autotuner)]
        self._heuristics = [w for w in self.wrappers if isinstance(w, triton.runtime.Heuristics)]
        self._sites: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def _named(self, args, kwargs) -> dict:
        named = dict(zip(self.names, args))
        named.update(kwargs)
        return named

    def _key(self, args, kwargs):
        names = self.names
        parts = [torch.cuda.current_device()]
        for i, value in enumerate(args):
            parts.append(value if names[i] in self.constexpr else _arg_key(value))
        for name, value in kwargs.items():  # call sites pass them in one order: no sort
            parts.append((name, value if name in self.constexpr or name not in names else _arg_key(value)))
        if self._tuners or self._heuristics:
            named = self._named(args, kwargs)
            for tuner in self._tuners:
                parts.extend(named.get(k) for k in tuner.keys)
            for heur in self._heuristics:
                parts.extend(fn(named) for fn in heur.values.values())
        return tuple(parts)

    def run(self, grid, args, kwargs):
        enabled = fast_launch_enabled()
        if enabled and not self._ready:
            self._prepare()
        runtime = triton.knobs.runtime
        if (
            not enabled
            or self.jit is None
            or _hooked(runtime.launch_enter_hook)
            or _hooked(runtime.launch_exit_hook)
        ):
            return self.kernel[grid](*args, **kwargs)
        try:
            key = self._key(args, kwargs)
            site = self._sites.get(key)
        except (_Unkeyable, TypeError, KeyError):  # an unhashable constexpr; a heuristic's missing input
            return self.kernel[grid](*args, **kwargs)
        if site is None:
            compiled = self.kernel[grid](*args, **kwargs)
            self._remember(key, compiled, args, kwargs)
            return compiled
        if site.pre_hook is not None:
            site.pre_hook({**self._named(args, kwargs), **site.hook_extras})
        values = self._values(args, kwargs, site.extras)
        if callable(grid):  # Triton calls it with every parameter bound, defaults included
            grid = grid(dict(zip(self.names, values)))
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled = site.compiled
        stream = triton.runtime.driver.active.get_current_stream(key[0])
        compiled.run(
            grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *values
        )
        return compiled

    def _values(self, args, kwargs, extras) -> list:
        """Every parameter's value in signature order (constexprs included), as Triton passes them."""
        values = list(args)
        for name in self.names[len(args) :]:
            if name in kwargs:
                values.append(kwargs[name])
            elif name in extras:
                values.append(extras[name])
            else:
                values.append(self.defaults[name])
        return values

    def _remember(self, key, compiled, args, kwargs) -> None:
        """Keep what the call Triton just launched resolved to: its compiled kernel, the constexprs and
        options its wrappers added (the autotuner's chosen configuration, the heuristics' values) and
        the configuration's pre-hook."""
        if compiled is None or not hasattr(compiled, "packed_metadata"):
            return
        if hasattr(compiled, "result"):  # an asynchronous compilation's future
            return
        extras: dict = {}
        pre_hook, hook_extras = None, {}
        named = self._named(args, kwargs)
        for wrapper in self.wrappers:  # outside-in, as their run() methods add them
            if isinstance(wrapper, triton.runtime.Heuristics):
                for name, fn in wrapper.values.items():
                    extras[name] = fn({**named, **extras})
            else:  # an Autotuner: _layers peels no other wrapper
                config = wrapper.best_config if len(wrapper.configs) > 1 else wrapper.configs[0]
                extras.update(config.kwargs)
                pre_hook, hook_extras = config.pre_hook, config.all_kwargs()
        missing = [n for n in self.names[len(args) :] if n not in kwargs and n not in extras]
        if any(n not in self.defaults for n in missing):
            return
        if compiled.function is None:
            return
        self._sites[key] = _Site(compiled, extras, pre_hook, hook_extras)


def fast(kernel) -> FastKernel:
    """`kernel` (a @triton.jit function, or one wrapped by triton.autotune / triton.heuristics, in any
    order) launched with the compiled kernels kept per call signature (see the module doc)."""
    return FastKernel(kernel)
