"""Layer placement across the devices of one host: which device runs which decoder layer.

One process holds the model; its decoder layers are split into contiguous ranges, one per
device, balanced by count (`Placement.balanced`). The embeddings, the final norm and the LM head
stay on the *primary* device (the first one), so logits, sampling and the batch runner's input
buffers live there as on one device. Hidden states hop to the next device at the first layer
of each range and back to the primary before the final norm (`PlacedModel`: forward pre-hooks,
no wrapper class, so transformers' own decoder loop and the batch scheduler run unchanged).

Devices are *logical*: `Placement.devices[i]` is the torch device of logical device `i`, and
two logical devices may name the same torch device (`cpu,cpu`): the fake two-device layout the
CPU tests run on. The admin routes and metrics name logical devices by index.

When a device is lost, `PlacedModel.replace(lost)` moves that device's layers to the survivors,
loading their weights from the host copy taken at start (`HostWeights`: pinned on CUDA), never
from the lost device; `PlacedModel.restore()` puts every layer back where it was. The host copy
also holds everything outside the decoder layers (embeddings, final norm, LM head, the rotary
tables: parameters and buffers), so losing the *primary* device moves the primary role to the
survivor that takes layer 0: those parts are loaded there from the host copy too, and return to
the home primary when it is restored.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.errors import ConfigError, KvtierError

ENV_DEVICES = "KVTIER_DEVICES"


class DeviceLost(KvtierError):
    """A device of the placement stopped working (a CUDA error, NVML says it is gone, or a fault
    was injected); the server re-places its layers on the surviving devices."""

    def __init__(self, device: int, reason: str) -> None:
        super().__init__(f"device {device} is lost: {reason}")
        self.device = device
        self.reason = reason


def parse_devices(spec: str | None, cuda_count: int | None = None) -> list[torch.device]:
    """Torch devices from a `--devices` value: `auto` (every visible GPU), `0,1` (CUDA ordinals),
    `cuda:0,cuda:1`, or `cpu,cpu` (logical CPU devices). Empty or None: no placement ([])."""
    if spec is None or not str(spec).strip():
        return []
    text = str(spec).strip().lower()
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if text == "auto":
        if count == 0:
            raise ConfigError(
                "devices=auto: no GPU is visible (CUDA_VISIBLE_DEVICES, driver); name the "
                "devices (--devices cpu) or leave --devices out"
            )
        return [torch.device("cuda", i) for i in range(count)]
    out = []
    for part in (p.strip() for p in text.split(",")):
        if part.isdigit():
            dev = torch.device("cuda", int(part))
        else:
            try:
                dev = torch.device(part)
            except RuntimeError:
                raise ConfigError(
                    f"devices: {part!r} is not a device; use auto, GPU ordinals like 0,1, or "
                    "cuda:0,cuda:1"
                ) from None
            if dev.type == "cuda" and dev.index is None:
                raise ConfigError(f"devices: name the GPU of {part!r} (cuda:0, or just 0)")
        if dev.type == "cuda" and (dev.index or 0) >= count:
            raise ConfigError(
                f"devices: GPU {dev.index} is not visible ({count} GPU(s)); check "
                "CUDA_VISIBLE_DEVICES or use --devices auto"
            )
        if dev.type == "cuda" and dev in out:
            raise ConfigError(f"devices: {dev} is named twice")
        out.append(dev)
    return out


def devices_setting(devices: str, env: Mapping[str, str] | None = None) -> str:
    """The configured devices: the `devices` setting, else the KVTIER_DEVICES variable."""
    return devices or (os.environ if env is None else env).get(ENV_DEVICES, "")


@dataclass(frozen=True)
class Placement:
    """`layers[i]` is the logical device of decoder layer i; `devices[d]` its torch device."""

    devices: tuple[torch.device, ...]
    layers: tuple[int, ...]

    @classmethod
    def balanced(cls, num_layers: int, devices: Sequence[torch.device]) -> Placement:
        """Contiguous ranges, one per device, whose sizes differ by at most one (the first
        devices take the extra layers)."""
        if not devices:
            raise ConfigError("a placement needs at least one device")
        if num_layers < len(devices):
            raise ConfigError(
                f"{len(devices)} devices for {num_layers} layers: name at most {num_layers}"
            )
        base, extra = divmod(num_layers, len(devices))
        layers: list[int] = []
        for d in range(len(devices)):
            layers.extend([d] * (base + (1 if d < extra else 0)))
        return cls(tuple(devices), tuple(layers))

    @property
    def primary(self) -> int:
        """The logical device of the embeddings, the final norm and the LM head."""
        return self.layers[0] if self.layers else 0

    def device_of(self, layer: int) -> torch.device:
        return self.devices[self.layers[layer]]

    def layers_on(self, device: int) -> list[int]:
        return [i for i, d in enumerate(self.layers) if d == device]

    def used(self) -> list[int]:
        """Logical devices holding at least one layer, in order."""
        return sorted(set(self.layers))

    def ranges(self) -> dict[int, tuple[int, int]]:
        """Each used device's first and last layer (inclusive)."""
        out: dict[int, tuple[int, int]] = {}
        for i, d in enumerate(self.layers):
            lo, _ = out.get(d, (i, i))
            out[d] = (lo, i)
        return out

    def without(self, lost: int) -> Placement:
        """The lost device's layers given to the survivors: split into contiguous pieces, the
        survivor with the fewest layers taking the next piece, so counts stay balanced."""
        if lost not in self.used():
            raise ConfigError(f"device {lost} holds no layer of this placement")
        survivors = [d for d in self.used() if d != lost]
        if not survivors:
            raise DeviceLost(lost, "no other device is left to take its layers")
        moved = self.layers_on(lost)
        counts = {d: len(self.layers_on(d)) for d in survivors}
        total = sum(counts.values()) + len(moved)
        # water-fill: each survivor's share of the total, minus what it holds, in layer order
        base, extra = divmod(total, len(survivors))
        want = {d: base + (1 if i < extra else 0) for i, d in enumerate(survivors)}
        new = list(self.layers)
        queue = list(moved)
        for d in sorted(survivors, key=lambda d: (counts[d], d)):
            take = max(0, want[d] - counts[d])
            for layer in queue[:take]:
                new[layer] = d
            queue = queue[take:]
        for layer in queue:  # rounding leftovers: the least loaded survivor
            d = min(survivors, key=lambda d: (new.count(d), d))
            new[layer] = d
        return Placement(self.devices, tuple(new))

    def describe(self) -> str:
        parts = [f"{d}:{self.devices[d]} layers {lo}-{hi}" for d, (lo, hi) in self.ranges().items()]
        return "; ".join(parts)


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The decoder layer list of a transformers causal LM (`model.model.layers`)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(
            f"{type(model).__name__} has no decoder layer list (model.<base>.layers); it cannot "
            "be placed across devices"
        )
    return layers


def _host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    host.copy_(t.detach())
    return host


class HostWeights:
    """A host copy of the model's weights, taken once (pinned when CUDA is in use): every
    decoder layer's state, and every parameter and buffer outside the decoder layers (the
    primary device's part: embeddings, final norm, LM head, rotary tables). A lost device's
    part is reloaded from here, never read from the device."""

    def __init__(self, model: Any, layers: torch.nn.ModuleList, pin: bool) -> None:
        self.states: list[dict[str, torch.Tensor]] = []
        for layer in layers:
            self.states.append({n: _host(t, pin) for n, t in layer.state_dict().items()})
        # the rest: (module, attribute, is_parameter) -> host copy; a tied parameter once
        inside = {id(m) for layer in layers for m in layer.modules()}
        self.rest: list[tuple[torch.nn.Module, str, bool, torch.Tensor]] = []
        seen: set[int] = set()
        for module in model.modules():
            if id(module) in inside:
                continue
            # the module's own (recurse=False), None entries skipped, in registration order
            for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    self.rest.append((module, name, True, _host(p, pin)))
            for name, b in module.named_buffers(recurse=False, remove_duplicate=False):
                self.rest.append((module, name, False, _host(b, pin)))

    @property
    def nbytes(self) -> int:
        layers = sum(t.numel() * t.element_size() for s in self.states for t in s.values())
        return layers + sum(t.numel() * t.element_size() for *_, t in self.rest)

    def load_rest(self, device: torch.device) -> None:
        """Give every parameter and buffer outside the decoder layers fresh storage on
        `device`, filled from the host copy (tied parameters stay tied: the Parameter object
        is kept, its data replaced)."""
        nb = device.type == "cuda"
        with torch.no_grad():
            for module, name, is_param, host in self.rest:
                if is_param:
                    p = module.get_parameter(name)
                    p.data = host.to(device, non_blocking=nb, copy=True)
                else:  # a registered buffer's name: setattr replaces it, persistence kept
                    setattr(module, name, host.to(device, non_blocking=nb, copy=True))
        if nb:
            torch.cuda.synchronize(device)

    def load(self, layer: torch.nn.Module, index: int, device: torch.device) -> None:
        """Give `layer` fresh storage on `device` filled from the host copy."""
        layer.to_empty(device=device)
        with torch.no_grad():
            for name, t in layer.state_dict().items():
                t.copy_(self.states[index][name], non_blocking=device.type == "cuda")
        # non-persistent buffers (none in Llama-like decoder layers) would need their init
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _move(value: Any, device: torch.device, memo: dict[Any, tuple[Any, Any]]) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        key = (id(value), device)
        hit = memo.get(key)
        if hit is not None and hit[0] is value:
            return hit[1]
        moved = value.to(device, non_blocking=True)
        memo[key] = (value, moved)  # holds `value`, so its id is not reused this forward
        return moved
    if isinstance(value, tuple):
        return tuple(_move(v, device, memo) for v in value)
    if isinstance(value, list):
        return [_move(v, device, memo) for v in value]
    if isinstance(value, dict):  # a layer's keyword arguments: position_embeddings, ...
        return {k: _move(v, device, memo) for k, v in value.items()}
    return value


class PlacedModel:
    """A transformers causal LM whose decoder layers run on the devices of a `Placement`.

    `fault` is a test hook: a callable run before each layer's forward with the layer's
    logical device; raising `DeviceLost` there is an injected failure in the middle of a
    forward (`inject_fault`).
    """

    def __init__(self, model: Any, placement: Placement) -> None:
        self.model = model
        self.layers = decoder_layers(model)
        if len(self.layers) != len(placement.layers):
            raise ConfigError(
                f"the placement covers {len(placement.layers)} layers, the model has "
                f"{len(self.layers)}"
            )
        self.home = placement
        self.placement = placement
        self.lost: set[int] = set()
        self._faults: dict[int, tuple[str, Callable[[], None] | None]] = {}
        self._lock = threading.Lock()
        self._memo: dict[Any, tuple[Any, Any]] = {}
        uses_cuda = any(d.type == "cuda" for d in placement.devices)
        self.host = HostWeights(model, self.layers, pin=uses_cuda and torch.cuda.is_available())
        primary = placement.devices[placement.primary]
        model.to(primary)  # embeddings, norm, head (and the layers, placed next)
        for i, layer in enumerate(self.layers):
            layer.to(placement.device_of(i))
        self._hooks = [
            layer.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True)
            for i, layer in enumerate(self.layers)
        ]
        base = getattr(model, getattr(model, "base_model_prefix", "model"))
        self._hooks.append(base.register_forward_pre_hook(self._start, with_kwargs=True))
        norm = getattr(base, "norm", None)
        if isinstance(norm, torch.nn.Module):
            self._hooks.append(norm.register_forward_pre_hook(self._home_hook, with_kwargs=True))

    # ---- forward hooks -----------------------------------------------------------------------

    def _start(self, module: Any, args: Any, kwargs: Any) -> None:
        self._memo.clear()  # a new forward: no tensor of the last one is reused
        return None

    def _pre_hook(self, index: int) -> Callable[..., Any]:
        def hook(module: Any, args: Any, kwargs: Any) -> tuple[Any, Any]:
            logical = self.placement.layers[index]
            if self._faults:
                self._check_fault(logical)
            device = self.placement.devices[logical]
            if device.type == "cuda":
                torch.cuda.set_device(device)  # Triton launches on the current device
            return _move(args, device, self._memo), _move(kwargs, device, self._memo)

        return hook

    def _home_hook(self, module: Any, args: Any, kwargs: Any) -> tuple[Any, Any]:
        device = self.primary_device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return _move(args, device, self._memo), _move(kwargs, device, self._memo)

    def _check_fault(self, logical: int) -> None:
        with self._lock:
            fault = self._faults.pop(logical, None)
        if fault is not None:
            reason, before = fault
            if before is not None:
                before()
            raise DeviceLost(logical, reason)

    def inject_fault(
        self,
        device: int,
        reason: str = "injected fault",
        before: Callable[[], None] | None = None,
    ) -> None:
        """The next forward fails with `DeviceLost(device)` when it reaches a layer of `device`
        (a fault in the middle of a batch: earlier layers have run); `before` runs first, on
        the forward's thread (a test poisons the device's memory there)."""
        if device not in self.placement.used():
            raise ConfigError(f"device {device} runs no layer now")
        with self._lock:
            self._faults[device] = (reason, before)

    # ---- re-placement ------------------------------------------------------------------------

    @property
    def primary_device(self) -> torch.device:
        return self.placement.devices[self.placement.primary]

    def make_primary_current(self) -> None:
        """The primary device as the current CUDA device (a forward that failed in a layer of
        another device left that one current; the batch runner's copies run on the primary)."""
        if self.primary_device.type == "cuda":
            torch.cuda.set_device(self.primary_device)

    def replace(self, lost: int) -> Placement:
        """Move the lost device's layers to the survivors (weights from the host copy). When
        it was the primary, the survivor now holding layer 0 becomes the primary and the
        embeddings, final norm, LM head and rotary tables are loaded there from the host copy.
        Raises `DeviceLost` when no other device is left."""
        new = self.placement.without(lost)
        with self._lock:
            self._faults.pop(lost, None)
        if new.primary != self.placement.primary:
            self.host.load_rest(new.devices[new.primary])
        for i, layer in enumerate(self.layers):
            if self.placement.layers[i] == lost:
                self.host.load(layer, i, new.device_of(i))
        self.lost.add(lost)
        self.placement = new
        self._memo.clear()
        return new

    def restore(self, device: int) -> Placement:
        """Device `device` is back: its home layers return to it (from the host copy)."""
        if device not in self.lost:
            raise ConfigError(f"device {device} is not marked lost; nothing to restore")
        self.lost.discard(device)
        new = list(self.placement.layers)
        for i, layer in enumerate(self.layers):
            home = self.home.layers[i]
            if home not in self.lost and new[i] != home:
                self.host.load(layer, i, self.home.device_of(i))
                new[i] = home
        placement = Placement(self.home.devices, tuple(new))
        if placement.primary != self.placement.primary:  # the home primary is back
            self.host.load_rest(placement.devices[placement.primary])
        self.placement = placement
        self._memo.clear()
        return self.placement

    def remove(self) -> None:
        """Take the hooks off (the model then runs wherever its layers are)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
