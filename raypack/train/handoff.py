"""The prepared data, handed from the driver to workers that started before it was ready.

    handoff = Handoff.remote()                         # driver: before the worker group starts
    ... TorchTrainer(loop_config={"data": handoff, ...}).fit() while, in a thread:
    handoff.put.remote({"prepared": prepared.to_dict(), "marks": {...}})   # or {"error": "..."}
    data = receive(config)                             # worker: a Prepared dict, waited for if need be

With train.overlap_start the driver starts the worker group as soon as Ray is up and prepares the
data meanwhile (raypack/train/trainer.py): the workers' processes, imports and process group, tens
of seconds, need not wait for tokenizing and packing where there are cores to run both. A zero-CPU
actor holds the record until the driver puts it; a worker asks and waits. A preparation that
fails hands over its error instead: every worker raises `PreparationFailed` (an InputError, so Ray
Train does not retry), and the driver raises the original.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from raypack.errors import InputError


class PreparationFailed(InputError):
    """The driver's data preparation failed; the driver reports why."""


@ray.remote(num_cpus=0)
class Handoff:
    """One value, put once by the driver, read by every worker (waiting until it is there)."""

    def __init__(self) -> None:
        self._ready = asyncio.Event()
        self._value: dict[str, Any] = {}

    async def put(self, value: dict[str, Any]) -> None:
        self._value = value
        self._ready.set()

    async def get(self) -> dict[str, Any]:
        await self._ready.wait()
        return self._value


def receive(config: dict[str, Any]) -> dict[str, Any]:
    """`config["data"]`: the Prepared record as a dict, waited for where it is a Handoff; the
    driver's start-up marks that came with it are added to `config["startup"]`."""
    data = config["data"]
    if isinstance(data, dict):
        return data
    value = ray.get(data.get.remote())
    if "error" in value:
        raise PreparationFailed(value["error"])
    config.setdefault("startup", {}).update(value.get("marks", {}))
    return value["prepared"]
