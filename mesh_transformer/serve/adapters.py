"""The LoRA adapters a server knows by name, and the bank entries they occupy (vLLM's --max-loras).

The generator's bank has a fixed number of entries (`lora.AdapterSet.slots`); a server may know
more adapters than that (`--lora-modules`, `/v1/load_lora_adapter`), each held on the host once
loaded and checked. The engine places a request's adapter in an entry when it admits the request:
the entry already holding it, else an idle one (no running row under it: empty ones first, then
the least recently admitted to), whose contents `Generator.write_adapter` replaces between device
calls, in place (nothing recompiles). While every entry has running rows, a request for an adapter
not in one waits, and the least recently admitted-to entry takes no new rows until it is idle and
the waiting request takes it: later requests for the adapters in the other entries go on meanwhile,
and a waiting adapter is never starved by traffic for the others.

With a cap on host memory (`host`, vLLM's --max-cpu-loras, at least the bank's entries) the leaves
of at most that many adapters are held by name, the least recently named dropped first (besides
them, each bank entry keeps the copy it was written from: at most `host` + entries in all). An
adapter whose leaves were dropped stays known by name and directory; when a request names it, its
bank entry's copy serves if it is in one, else it is read from its directory again (`get`: from a
handler's worker thread, never the engine's; one read per adapter at a time). A reload is the same
load (its serial), so the prefix cache and a bank entry still holding it serve it as before: the
directory is assumed unchanged (to serve new weights under a name, load them with `load_inplace`).
Requests in flight keep their adapter's leaves until they finish.

Only the engine thread calls the placement methods (`entry_for`, `drained`, `pin`, `release`,
`place`); request handlers call `add`, `remove`, `get` and `names`, which hold this object's lock.
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from typing import Optional

from mesh_transformer import lora
from mesh_transformer.config import ConfigError
from mesh_transformer.evaluate.scoring import forget_adapter
from mesh_transformer.generate import Generator

log = logging.getLogger("mesh_transformer.serve")


class AdapterSlots:
    """The adapters known by name (`known`) and what each bank entry holds or will hold (`holds`)."""

    def __init__(self, gen: Generator, host: Optional[int] = None):
        if gen.adapters is None:
            raise ValueError("the generator serves no adapters (it has no bank: Generator(adapters=...))")
        if host is not None and host < gen.adapters.slots:
            raise ValueError(f"adapters held in host memory ({host}) must be at least the bank's entries "
                             f"({gen.adapters.slots}): --max-cpu-loras >= --max-loras")
        self.gen, self.host = gen, host
        self.known: dict[str, lora.ServedAdapter] = {a.name: a for a in gen.adapters.adapters}
        self._held: OrderedDict[str, None] = OrderedDict.fromkeys(  # leaves held, least recent first
            name for name, a in self.known.items() if a.leaves is not None)
        self.reloads = 0  # adapters read from their directory again since start
        self._reading: dict[str, threading.Lock] = {}  # name -> held while its directory is read again
        self.holds: list[Optional[lora.ServedAdapter]] = list(gen.residents)  # entry -> adapter (planned)
        self.running = [0] * len(self.holds)  # rows admitted under each entry and not finished
        self.used = [0] * len(self.holds)  # when each entry was last admitted to (`_clock`)
        self._clock = itertools.count(1)
        self.placed = 0  # adapters written into an entry since start
        self._lock = threading.Lock()
        with self._lock:
            self._drop_beyond_cap()
        if host is not None:  # the generator's set has been placed: these hold the leaves from now on
            gen.adapters = gen.adapters._replace(adapters=tuple(a._replace(leaves=None) for a in gen.adapters.adapters))

    @property
    def slots(self) -> int:
        return len(self.holds) - 1

    # ---- by name (request handlers) ----------------------------------------------------------

    def names(self) -> list[str]:
        with self._lock:
            return list(self.known)

    def get(self, name: str) -> Optional[lora.ServedAdapter]:
        """The adapter called `name`, its leaves read from its directory again if they were dropped
        (None if no adapter has the name; ConfigError naming it if its directory no longer holds it).
        One read at a time per adapter: concurrent requests for it wait for that one."""
        while True:
            with self._lock:
                found = self.known.get(name)
                if found is None or found.leaves is not None:
                    return self._named(found)
                resident = self._in_bank(found.serial)
                if resident is not None:  # the copy its bank entry was written from: nothing to read
                    self.known[name] = resident
                    return self._named(resident)
                reading = self._reading.setdefault(name, threading.Lock())
            with reading:
                with self._lock:
                    if self.known.get(name) is not found:  # read, replaced or removed meanwhile: look again
                        continue
                try:
                    again = lora.served_adapter(name, found.directory, self.gen.config, self.gen.mp)
                    lora.check_fits(again, self.gen.adapters.plan)
                except ConfigError as e:
                    log.warning("could not read LoRA adapter %r again: %s", name, e)
                    raise
                with self._lock:
                    if self.known.get(name) is not found:
                        continue
                    self.known[name] = again._replace(serial=found.serial)
                    self.reloads += 1
                    log.info("read LoRA adapter %r from %s again (--max-cpu-loras %s)", name, found.directory,
                             self.host)
                    return self._named(self.known[name])

    def held(self, name: str) -> Optional[lora.ServedAdapter]:
        """The adapter called `name` if its leaves are in host memory (`get` would read nothing; it is
        then the most recently named), else None."""
        with self._lock:
            found = self.known.get(name)
            return self._named(found) if found is not None and found.leaves is not None else None

    def add(self, adapter: lora.ServedAdapter, replace: bool = False) -> None:
        """Know `adapter` by its name (ConfigError if it does not fit the bank; NameTaken if an
        adapter has the name, unless `replace`: then requests naming it get this one from now on)."""
        lora.check_fits(adapter, self.gen.adapters.plan)
        with self._lock:
            if adapter.name in self.known and not replace:
                raise NameTaken(f"the adapter {adapter.name!r} has already been loaded")
            replaced = self.known.get(adapter.name)
            self.known[adapter.name] = adapter
            self._named(adapter)
        if replaced is not None:
            forget_adapter(self.gen, replaced.serial)

    def remove(self, name: str) -> lora.ServedAdapter:
        """Forget the adapter called `name` (KeyError if none is): new requests cannot name it;
        requests already submitted under it finish with it, and its entry is reused once idle. The
        prompt scorer's copy of its leaves, if any, is dropped."""
        with self._lock:
            self._held.pop(name, None)
            self._reading.pop(name, None)
            removed = self.known.pop(name)
        forget_adapter(self.gen, removed.serial)
        return removed

    def _named(self, adapter: Optional[lora.ServedAdapter]) -> Optional[lora.ServedAdapter]:
        """`adapter` (with its leaves) was just named: the most recent; drop the leaves of the least
        recent beyond the cap. Under the lock."""
        if adapter is not None:
            self._held[adapter.name] = None
            self._held.move_to_end(adapter.name)
            self._drop_beyond_cap()
        return adapter

    def _in_bank(self, serial: int) -> Optional[lora.ServedAdapter]:
        """The adapter of this load that a bank entry holds or is planned to, with its leaves, or None.
        (Read from a handler's thread: the engine's lists change by whole items.)"""
        return next((a for a in (*self.holds, *self.gen.residents)
                     if a is not None and a.serial == serial and a.leaves is not None), None)

    def _drop_beyond_cap(self) -> None:
        """Drop the leaves of the least recently named adapters until `host` hold theirs (never the
        one just named: `host` >= 1). Under the lock."""
        while self.host is not None and len(self._held) > self.host:
            name, _ = self._held.popitem(last=False)
            self.known[name] = self.known[name]._replace(leaves=None)  # name, directory, serial kept

    # ---- placement (the engine thread) ---------------------------------------------------------

    def entry_for(self, adapter: Optional[lora.ServedAdapter], kept: set[int]) -> Optional[int]:
        """The entry a sequence under `adapter` runs in (0: the base): the one holding it, else an
        idle one, which then holds it (written by `place`); None while every entry not in `kept`
        (entries drained for a waiting sequence) has running rows."""
        if adapter is None:
            return 0
        held = self.entry_of(adapter)
        if held is not None:
            return None if held in kept else held
        idle = [e for e in range(1, len(self.holds)) if self.running[e] == 0 and e not in kept]
        if not idle:
            return None
        e = min(idle, key=lambda e: (self.holds[e] is not None, self.used[e]))
        self.holds[e] = adapter
        return e

    def entry_of(self, adapter: lora.ServedAdapter) -> Optional[int]:
        """The entry holding `adapter` (this load of it), or None."""
        return next((e for e in range(1, len(self.holds))
                     if self.holds[e] is not None and self.holds[e].serial == adapter.serial), None)

    def drained(self, kept: set[int]) -> Optional[int]:
        """The entry to keep for a sequence that found none (`entry_for`): the least recently
        admitted to of those not kept already (None if every entry is)."""
        free = [e for e in range(1, len(self.holds)) if e not in kept]
        return min(free, key=lambda e: self.used[e]) if free else None

    def pin(self, entry: int) -> None:
        """A row is admitted under `entry`."""
        self.running[entry] += 1
        self.used[entry] = next(self._clock)

    def release(self, entry: int) -> None:
        """A row under `entry` finished."""
        self.running[entry] = max(0, self.running[entry] - 1)

    def release_all(self) -> None:
        """No row runs (the engine started a new batch after a failure)."""
        self.running = [0] * len(self.holds)

    def place(self) -> set[int]:
        """Write each entry whose planned adapter the bank does not hold yet (before the admission
        that reads it) -> the entries that could not be written (logged; they keep what they held)."""
        failed = set()
        for e, adapter in enumerate(self.holds):
            if e and adapter is not self.gen.residents[e]:
                try:
                    self.gen.write_adapter(e, adapter)
                    self.placed += 1
                except Exception:  # noqa: BLE001 - fail the rows that needed it, keep serving
                    log.exception("could not write LoRA adapter %r into bank entry %d", adapter.name, e)
                    self.holds[e] = self.gen.residents[e]
                    failed.add(e)
        return failed

    def stats(self) -> dict:
        """Counts only (GET /health is open: adapter names are for clients with the key, /v1/models)."""
        with self._lock:
            known, held = len(self.known), len(self._held)
        return {"known": known, "held": held, "reloads": self.reloads, "slots": self.slots, "placed": self.placed,
                "running": self.running[1:]}


class NameTaken(ValueError):
    """An adapter already has this name."""
