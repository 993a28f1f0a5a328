"""The disk path into SGLang: on the engine host, feed a server from the disk-delta reader's local copy.

The trainer publishes versions with transport "disk_delta" (`delta_dir`, one
store per pipeline stage). On each SGLang host, `SGLangDiskFeeder` keeps the
host's local copy with one `DeltaReader` per stage (two safetensors slots
each: the committed version and the one being staged) and points the server
at the staged slot files: a model directory of links, the server's own
config and tokenizer files beside one `model-0000s.safetensors` link per
stage, loaded with /update_weights_from_disk (tagged with the version). The
copy commits only once SGLang loaded it. SGLang's own rollback after a failed
disk load re-reads the path it failed on, so a failed load is undone here:
the committed slots, untouched, are loaded again, and the staged version is
discarded. Nothing is copied besides the delta decoding into the slot.
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional, Sequence

from megatron_sync.engines.http import EngineHTTPError
from megatron_sync.engines.sglang import requests
from megatron_sync.engines.sglang.client import call_sglang
from megatron_sync.transports.disk_delta.reader import DeltaReader
from megatron_sync.transports.disk_delta.transport import stage_store


class SGLangDiskFeeder:
    """Brings one SGLang server to the newest published version through this host's local copy."""

    def __init__(self, url: str, *, delta_dir: str, local_dir: str, num_stages: int = 1, timeout_s: float = 300.0,
                 pause_mode: str = "abort") -> None:
        self.url, self.local_dir, self.timeout_s, self.pause_mode = url.rstrip("/"), local_dir, timeout_s, pause_mode
        self.readers = [DeltaReader(stage_store(delta_dir, stage), os.path.join(local_dir, f"stage-{stage}"))
                        for stage in range(num_stages)]
        self.model_dir = self._call("/model_info", method="GET")["model_path"]  # config and tokenizer live there

    @property
    def version(self) -> Optional[int]:
        """The version the local copy (and the server, once fed) holds; None before the first."""
        return self.readers[0].version

    def feed(self, target: Optional[int] = None) -> Optional[int]:
        """Stage `target` (default: the newest published), load it into the server, commit; return the version held.

        Raises EngineHTTPError (the server refused or failed the load: it is back on the committed version),
        or the reader's error (nothing was touched).
        """
        staged = []
        try:
            for reader in self.readers:
                staged.append(reader.stage(target))
        except BaseException:
            self._discard(staged)
            raise
        if all(one is None for one in staged):
            return self.version
        version = next(one.version for one in staged if one is not None)
        files = [one.file if one is not None else reader.committed_file for one, reader in zip(staged, self.readers)]
        self._call("/pause_generation", body=requests.pause_generation(self.pause_mode))
        try:
            self._load(files, str(version))
        except EngineHTTPError:
            self._discard(staged)
            self._undo()
            raise
        for reader, one in zip(self.readers, staged):
            if one is not None:
                reader.commit(one)
        self._call("/continue_generation", body=requests.continue_generation())
        return version

    def _undo(self) -> None:
        """Load the committed slots again (SGLang's own rollback re-reads the failed path); resume if it worked."""
        if self.version is None:
            return  # nothing committed yet: the server keeps whatever it loaded; it stays paused
        self._load([r.committed_file for r in self.readers], str(self.version))
        self._call("/continue_generation", body=requests.continue_generation())

    def _load(self, files: Sequence[str], version: str) -> None:
        self._call("/update_weights_from_disk", body={"model_path": self._linked(files), "weight_version": version,
                                                      "flush_cache": True})

    def _linked(self, files: Sequence[str]) -> str:
        """Return a model directory: the server's own non-weight files, and `files` as its safetensors shards."""
        key = hashlib.sha1("\n".join(os.path.realpath(f) for f in files).encode()).hexdigest()[:12]
        folder = os.path.join(self.local_dir, f"sglang-{key}")
        os.makedirs(folder, exist_ok=True)
        links = {name: os.path.join(self.model_dir, name) for name in os.listdir(self.model_dir)
                 if not name.endswith(".safetensors") and not name.endswith(".safetensors.index.json")}
        links.update({f"model-{i:05d}.safetensors": os.path.realpath(f) for i, f in enumerate(files)})
        for name, target in links.items():
            path = os.path.join(folder, name)
            if not os.path.lexists(path):
                os.symlink(target, path)
        return folder

    def _discard(self, staged: list) -> None:
        for reader, one in zip(self.readers, staged):
            if one is not None:
                reader.discard(one)

    def close(self) -> None:
        """Release the readers (their applier locks)."""
        for reader in self.readers:
            reader.close()

    def _call(self, route: str, *, method: str = "POST", body: Optional[dict] = None) -> dict:
        return call_sglang(self.url, route, method=method, body=body, timeout_s=self.timeout_s)
