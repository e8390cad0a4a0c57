"""Which CUDA kernels a hybrid layer's packed forward would call, and whether each keeps a packed
row's examples apart (raypack/model/mixers.py takes the kernels path only where they all do).

transformers 5 binds each kernel function once, when it imports the model's module
(`use_kernel_func_from_hub_with_fallback`): the package's function where it imports, else its own
torch fallback. It then hands that function only the keyword arguments its signature names:

    kwargs = {k: v for k, v in kwargs.items() if k in applicable_params}

so a causal-conv1d whose `causal_conv1d_fn` takes no `seq_idx`, a mamba-ssm scan without it, or
a flash-linear-attention `chunk_gated_delta_rule` without `cu_seqlens` would get the whole packed
row with the boundaries silently dropped. `problem` finds each function the way transformers
does and reads its signature: the keyword must be a named parameter (a `**kwargs` catch-all is
filtered out by the line above).

Hub kernels. With the `kernels` package installed (transformers 5.25 installs it), transformers
also loads a model "kernelized" (`from_pretrained`'s `use_kernels`, on by default there; off
before, and never applied by `from_config`): every layer class decorated for hub kernels gets its
forward replaced by one downloaded from the Hub for the device, or, with none for the device, has
its instance's own `forward` removed, and so do the private copies of the kernel functions a layer
calls (`_kernel_funcs`); again at every `train()` and `eval()` that changes the mode. Removing the
instance's forward drops raypack's packed forward (mixers.install) from Qwen3.5's gated delta rule
layer, which then hands the boundaries to its torch fallback (which refuses them, on the CPU); a
hub function in place of the package's skips transformers' signature filter and `problem`'s check
alike. So raypack loads packed models without them (`HUB_KERNELS_OFF`), and `swapped` finds the
trait in a loaded layer, whatever turned it on.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass


HUB_KERNELS_OFF = {"use_kernels": False}
"""`from_pretrained`'s keywords for a model raypack trains on packed rows: the layers as transformers
wrote them, calling the kernel packages `problem` checks (or their torch fallbacks), as
`from_config` builds them; the default before transformers 5.25."""


def swapped(module, packed_forward) -> list[str]:
    """What of `module` (a mixer raypack routed) a hub kernel replaced or kernelization removed:
    its forward, where raypack's packed forward is no longer the instance's, and each kernel
    function whose private copy has a forward of its own (a hub kernel's: the torch one is the
    class's). Empty: the layer runs raypack's forward over transformers' own functions."""
    found = []
    forward = module.__dict__.get("forward")
    if getattr(forward, "func", None) is not packed_forward:  # functools.partial(packed_forward, ...)
        found.append("forward")
    for name, function in (module.__dict__.get("_kernel_funcs") or {}).items():
        if "forward" in vars(function):
            found.append(name)
    return found


@dataclass(frozen=True)
class KernelCall:
    """A kernel function transformers' layer calls on packed rows, and what keeps examples apart in it."""

    function: str
    """Its name, as transformers looks it up."""
    package: str
    """The import name of the package that ships it."""
    where: str
    """Its module inside the package ('' for the top level), as transformers resolves it."""
    boundaries: str
    """The keyword that carries the examples' boundaries: transformers drops it unless the
    function's signature names it."""


CONV = KernelCall("causal_conv1d_fn", "causal_conv1d", "", "seq_idx")
DISTRIBUTIONS = {"causal_conv1d": ("causal-conv1d",), "mamba_ssm": ("mamba-ssm",),
                 "fla": ("flash-linear-attention", "fla-core")}  # fmt: skip
"""The pip names of the kernel packages, for messages."""


def _resolve(call: KernelCall):
    """The function transformers binds for `call`, found as it finds it (the package's attribute
    path, else the submodule imported), or the reason there is none."""
    try:
        module = importlib.import_module(call.package)
        found = module
        for part in [*filter(None, call.where.split(".")), call.function]:
            found = getattr(found, part, None)
            if found is None:
                break
        if found is None and call.where:
            found = getattr(importlib.import_module(f"{call.package}.{call.where}"), call.function, None)
    except Exception as e:  # an extension built for another torch or CUDA: transformers falls back too
        reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        return None, f"{call.package} does not import ({reason})"
    if found is None:
        return None, f"{_version(call.package)} has no {call.function}"
    return found, None


def _version(package: str) -> str:
    for dist in DISTRIBUTIONS.get(package, (package,)):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return package


def problem(calls: tuple[KernelCall, ...]) -> str | None:
    """Why the kernels `calls` name, installed here, would not keep a packed row's examples apart
    (None: they would): a function that does not import or is missing, or whose signature does
    not name the keyword carrying the boundaries, which transformers then drops."""
    for call in calls:
        function, why = _resolve(call)
        if why is not None:
            return why
        try:
            params = inspect.signature(function).parameters
        except (TypeError, ValueError):
            return f"{_version(call.package)}'s {call.function} has no signature to read"
        named = params.get(call.boundaries)
        if named is None or named.kind in (named.VAR_KEYWORD, named.VAR_POSITIONAL, named.POSITIONAL_ONLY):
            return (f"{_version(call.package)}'s {call.function} takes no {call.boundaries}, so transformers would "
                    "drop the boundaries")
    return None
