"""The trainer driver's start-up pieces: the HF config and converter it syncs under, and the sync session its
first joining rank hosts and the others join (`megatron_sync.drivers.sync.TrainerWeightSync`)."""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Callable, Optional

import torch

from megatron_sync.convert import get_converter
from megatron_sync.convert.model_digest import model_digest, model_fields
from megatron_sync.core.agreement import failing_together
from megatron_sync.core.grid import ParallelLayout
from megatron_sync.core.meta import dtype_from_name
from megatron_sync.session.files import FileRendezvous, presenting
from megatron_sync.session.rendezvous import Identity, expectations
from megatron_sync.session.secret import SessionSecret
from megatron_sync.session.session import SyncSession, new_session_id
from megatron_sync.settings.config import WeightSyncConfig

log = logging.getLogger("megatron_sync")


def load_hf_config(config: WeightSyncConfig, hf_config: Any = None) -> Any:
    """Return `hf_config` when given (a transformers config or a dict), else the JSON at `config.hf_config_path`."""
    if hf_config is not None:
        return hf_config
    if config.hf_config_path is None:
        raise ValueError(
            "no HF config for the inference model: set weight_sync.hf_config_path to its config.json "
            "or pass hf_config= (the shapes every converted tensor is checked against)"
        )
    try:
        with open(config.hf_config_path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"weight_sync.hf_config_path={config.hf_config_path!r} cannot be read as a config.json: "
                         f"{e}") from e


def build_converter(config: WeightSyncConfig, hf_config: Any = None) -> Any:
    """Return the converter for `config.family`, `config.dtype` and `config.draft` over the HF config (`load_hf_config`)."""
    hf_config = load_hf_config(config, hf_config)
    return get_converter(config.require_family(), hf_config, dtype=dtype_from_name(config.dtype),
                         draft=config.draft == "sync")


def trainer_identity(config: WeightSyncConfig, layout: ParallelLayout, transport_cls: Any, hf_config: Any, *,
                     job: str, member: int, session: Optional[str]) -> Identity:
    """Return what a trainer rank presents at the session: its settings (`expectations`) and its model."""
    if hf_config is None:
        log.warning("no HF config (a converter was passed without hf_config=): the rendezvous cannot compare "
                    "the engines' model-defining config fields with the trainer's")
    return Identity(job=job, role="trainer", member=member, session=session,
                    expects=expectations(config, trainer_stages=layout.pp, shares=transport_cls.shares,
                                         backend=config.resolved_backend(torch.cuda.is_available())),
                    model=model_fields(hf_config) if hf_config is not None else None)


def files_presentation(config: WeightSyncConfig, layout: ParallelLayout, transport_cls: Any, hf_config: Any,
                       secret: Optional[SessionSecret]) -> Optional[FileRendezvous]:
    """Return what this trainer rank presents at a directory session (`Transport.meets_in_files`), else None.
    Only stage 0's source hosts one; the job is named by a fresh id, as no other rank of it presents."""
    if not transport_cls.meets_in_files:
        return None
    identity = trainer_identity(config, layout, transport_cls, hf_config, job=f"trainer-{uuid.uuid4().hex[:8]}",
                                member=0, session=config.run_id)
    return presenting(identity, timeout_s=config.timeout_s, secret=secret)


def open_trainer_session(config: WeightSyncConfig, layout: ParallelLayout, transport_cls: Any, hf_config: Any,
                         gather: Callable[[Any], list], secret: Optional[SessionSecret],
                         opened: Callable[[SyncSession], None]) -> None:
    """Host (the first joining trainer rank) or join the sync session, handing it to `opened` as soon as it
    exists (a failure of another rank afterwards must still close it and tell the engines); collective on
    every trainer rank."""
    joins = transport_cls.trainer_joins(layout)
    token = uuid.uuid4().hex  # the first trainer rank's token names the trainer job
    roster = gather({"joins": joins, "token": token, "session": config.run_id or new_session_id()})
    members = [entry["token"] for entry in roster if entry["joins"]]
    me = members.index(token) if joins else None
    identity = trainer_identity(config, layout, transport_cls, hf_config, job=f"trainer-{roster[0]['token'][:8]}",
                                member=me if me is not None else -1, session=roster[0]["session"])
    where = (config.master_address, config.master_port)
    with failing_together("hosting the sync session", gather):
        if me == 0:
            fleet = config.fleet  # a fleet's engines join whenever they come (not members)
            opened(session := SyncSession.host(
                *where, identity, timeout_s=config.timeout_s,
                members={"trainer": len(members)} if fleet else {"trainer": len(members),
                                                                  "inference": config.num_inference_ranks},
                engine_ranks=config.engine_tp_size if fleet else None, secret=secret))
            log.info("hosting weight-sync session %s at %s:%d (model digest %s)", session.id, *where,
                     model_digest(identity.model or {})[:12])
    with failing_together("joining the sync session", gather):
        if me is not None and me > 0:
            opened(SyncSession.join(*where, identity, timeout_s=config.timeout_s, secret=secret))
