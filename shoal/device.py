"""The one place that knows about accelerators: which device a process computes on, in which precision,
how much memory it has, and how tensors cross between it and host memory.

Everything else takes a `torch.device` and asks this module; no other module names a backend. A
process chooses once (`choose_device`), from `--device auto|cpu|cuda|cuda:N|mps`:

    device = choose_device("auto")           # the first CUDA device, else MPS, else the CPU (logged)
    dtype = autocast_dtype(device, "auto")   # bf16 where the device has it, None (fp32) otherwise
    with autocast(device, dtype): y = stage(x)

The wire stays device-free: `to_host` brings a tensor to host memory once per hop (through pinned
memory on CUDA), and a receiver copies host bytes straight to its device (`to_device`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import resource
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

COMPUTE_DTYPES = ("auto", "float32", "bfloat16")  # a run's `pipeline.compute_dtype` (autocast_dtype)

logger = logging.getLogger(__name__)

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N or mps"
DEVICE_HELP = (
    f"where to compute: {DEVICE_CHOICES}; auto (the default) takes the first CUDA device, else Apple's MPS, "
    "else the CPU"
)
_SPEC = re.compile(r"auto|cpu|mps|cuda(:\d{1,3})?")


class DeviceError(ValueError):
    """A device asked for that this machine does not have; `str()` is one line for the user."""


def check_device_spec(spec: str) -> str | None:
    """Why `spec` is not a device choice (None: it is one). Syntax only: availability is `choose_device`'s."""
    if _SPEC.fullmatch(spec) is None:
        return f"must be {DEVICE_CHOICES}, got {spec!r}"
    return None


def choose_device(spec: str = "auto") -> torch.device:
    """The device `spec` names, checked to exist here. `auto` takes the first CUDA device, else MPS,
    else the CPU, and says so in one log line when it falls back to the CPU."""
    problem = check_device_spec(spec)
    if problem is not None:
        raise DeviceError(f"--device {problem}")
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        if _mps_available():
            return torch.device("mps")
        logger.info("no CUDA or MPS device found: computing on the CPU")
        return torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "mps":
        if not _mps_available():
            raise DeviceError("--device mps: this machine has no MPS device (Apple silicon with a torch built for it)")
        return torch.device("mps")
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {spec}: this machine has no CUDA device (or torch was built without CUDA)")
    index = int(spec.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"--device {spec}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return torch.device("cuda", index)


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return backend is not None and backend.is_available()


def supports_bf16(device: torch.device) -> bool:
    """Whether bf16 autocast is fast and exact enough to be the default here: Ampere or later on CUDA,
    MPS on torch builds that have it. The CPU runs bf16 (a run may ask for it), but slower than fp32."""
    if device.type == "cuda":  # compute capability 8.0 (Ampere) and later; emulated bf16 is slow, not "has it"
        return torch.cuda.get_device_capability(device)[0] >= 8
    if device.type == "mps":
        try:  # macOS 14 and later
            torch.ones(1, device=device, dtype=torch.bfloat16)
        except (RuntimeError, TypeError):
            return False
        return True
    return False


def autocast_dtype(device: torch.device, setting: str) -> torch.dtype | None:
    """The autocast dtype for a run's `pipeline.compute_dtype` on `device`; None: plain float32.
    `auto` is bf16 where `supports_bf16`, else float32, so pre-Ampere cards and CPUs run as before."""
    if setting == "float32":
        return None
    if setting == "bfloat16":
        return torch.bfloat16
    if setting != "auto":
        raise ValueError(f"compute dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {setting!r}")
    return torch.bfloat16 if supports_bf16(device) else None


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` on `device` (a no-op for None): matrix products in `dtype`, the rest, the
    weights, their gradients and the optimizer state in float32."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@contextlib.contextmanager
def compute_context(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    """What a compute thread enters around each job: `device` as its current CUDA device (so that
    `cuda:1` never allocates a stray tensor on card 0) and `dtype` autocast there."""
    current = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with current, autocast(device, dtype):
        yield


def compute_kind(device: torch.device, dtype: torch.dtype | None) -> str:
    """Where a job runs, as `device type:dtype` (`cpu:float32`): two replays of one step agree bit for
    bit only on the same kind (shoal.train.step_audit)."""
    return f"{device.type}:{str(dtype or torch.float32).removeprefix('torch.')}"


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory, detached; itself when it is there already. From CUDA through a pinned
    buffer, so the copy runs at the bus's speed and the caller may read the result at once."""
    t = t.detach()
    if t.device.type == "cpu":
        return t
    if t.device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()
        return host
    return t.to("cpu")


def float64(t: torch.Tensor) -> torch.Tensor:
    """`t` in float64 for an exact sum or norm: where it is, or in host memory on MPS (no float64 there)."""
    t = t.detach()
    return (t.to("cpu") if t.device.type == "mps" else t).double()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: one copy on an accelerator, `t` itself on the CPU."""
    return t if t.device == device else t.to(device)


@dataclass(frozen=True)
class DeviceInfo:
    """What a node announces of where it computes: kind, model name, and memory (the accelerator's,
    or the host's on the CPU), total and free now."""

    kind: str  # "cpu", "cuda", "mps"
    name: str
    total_bytes: int
    free_bytes: int


def describe(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceInfo("cuda", torch.cuda.get_device_name(device), int(total), int(free))
    if device.type == "mps":
        total = int(torch.mps.recommended_max_memory())
        used = int(torch.mps.driver_allocated_memory())
        return DeviceInfo("mps", "Apple MPS", total, max(0, total - used))
    total, free = host_memory_bytes()
    return DeviceInfo("cpu", cpu_name(), total, free)


def host_memory_bytes() -> tuple[int, int]:
    """(total, available) host memory: /proc/meminfo where there is one, else sysconf."""
    found: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    found[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    total = found.get("MemTotal") or page * os.sysconf("SC_PHYS_PAGES")
    return total, found.get("MemAvailable") or page * os.sysconf("SC_AVPHYS_PAGES")


@functools.cache
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return " ".join(line.partition(":")[2].split())[:80]
    except OSError:
        pass
    return (os.uname().machine or "cpu")[:80]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timings on an accelerator mean nothing without it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def memory_in_use(device: torch.device) -> int:
    """Bytes held now: allocated by torch on CUDA, the driver's allocation on MPS, the process's
    resident set on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    if device.type == "mps":
        return int(torch.mps.driver_allocated_memory())
    return resident_bytes()


def resident_bytes() -> int:
    """Current resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class PeakMemory:
    """The most memory held above the level at entry, over a `with` block:

        with PeakMemory(device) as peak:
            work()
        peak.bytes

    On CUDA, torch's allocator counts it. On the CPU, a thread reads the resident set every
    millisecond, and the kernel's high-water mark is added where this process may reset it
    (/proc/self/clear_refs): the lifetime peak `getrusage` reports can come from before the block
    (an import's transient, seen in CI), so it is never used here."""

    def __init__(self, device: torch.device, interval_s: float = 0.001):
        self.device, self.interval_s = device, interval_s
        self.bytes = 0
        self._before = 0
        self._sampled = 0
        self._hwm_reset = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        self._before = memory_in_use(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == "cpu":
            self._hwm_reset = _reset_high_water_mark()
            self._sampled = self._before
            self._thread = threading.Thread(target=self._sample, name="peak-memory", daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sampled = max(self._sampled, resident_bytes())

    def __exit__(self, *exc: object) -> None:
        synchronize(self.device)
        if self.device.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated(self.device))
        elif self.device.type == "mps":
            peak = max(self._before, memory_in_use(self.device))
        else:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            peak = max(self._sampled, resident_bytes())
            if self._hwm_reset:
                peak = max(peak, _high_water_mark())
        self.bytes = max(0, peak - self._before)


def _reset_high_water_mark() -> bool:
    """Reset the kernel's peak resident set of this process (Linux); False where it may not."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _high_water_mark() > 0
    except OSError:
        return False


def _high_water_mark() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this process has held: allocated by torch on CUDA (since the last reset), the
    driver's allocation on MPS, and the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "mps":
        return int(torch.mps.driver_allocated_memory())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
