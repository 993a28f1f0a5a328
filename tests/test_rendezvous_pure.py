"""The join handshake as pure decisions, and the model digest's field list (tables, no processes)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from megatron_sync.settings.config import WeightSyncConfig
from megatron_sync.convert.model_digest import defining_field_names, model_digest, model_fields
from megatron_sync.session.rendezvous import Admission, Identity, expectations, host_unproven, signed
from megatron_sync.session.secret import SECRET_ENV, SessionSecret

CONFIG = WeightSyncConfig(family="qwen3", num_inference_ranks=2, engine_tp_size=2, dtype="float32")
QWEN3 = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 250,
         "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}


def _trainer(**expects) -> Identity:
    return Identity(job="T", role="trainer", member=0, session="S",
                    expects={**expectations(CONFIG, trainer_stages=1, backend="gloo"), **expects},
                    model=model_fields(QWEN3))


def _engine(member: int = 0, job: str = "E", model: dict | None = None, **expects) -> Identity:
    return Identity(job=job, role="inference", member=member,
                    expects={**expectations(CONFIG, trainer_stages=1, backend="gloo"), **expects},
                    model=model_fields({**QWEN3, **(model or {})}))


def _admission(trainer: Identity | None = None) -> Admission:
    return Admission("S", trainer or _trainer(), {"trainer": 1, "inference": 2})


# ---- what a disagreement says ----

DISAGREEMENTS = [
    ({"num_inference_ranks": 1}, "trainer expects 2 inference ranks, this inference job has 1"),
    ({"trainer_stages": 1, "_trainer": {"trainer_stages": 2}}, "trainer has 2 pipeline stages, this inference job expects 1"),
    ({"engine_tp_size": 1}, "trainer expects engines of 2 ranks (engine_tp_size), this inference job has 1"),
    ({"transport": "p2p"}, "trainer uses transport 'broadcast', this inference job uses 'p2p'"),
    ({"backend": "nccl"}, "trainer uses backend 'gloo', this inference job uses 'nccl'"),
    ({"dtype": "bfloat16"}, "trainer sends dtype 'float32', this inference job computes in 'bfloat16'"),
    ({"family": "llama"}, "trainer converts model family 'qwen3', this inference job serves 'llama'"),
    ({"bucket_size_mb": 64.0}, "trainer cuts buckets of 512.0 MiB, this inference job expects 64.0"),
    ({"draft": "skip"}, "trainer handles the draft (MTP) layers with draft='sync', this inference job with 'skip'"),
]


@pytest.mark.parametrize("change, words", DISAGREEMENTS, ids=[w.split(",")[0] for _, w in DISAGREEMENTS])
def test_a_layout_disagreement_is_refused_naming_both_values_and_fails_the_session(change, words):
    change = dict(change)
    admission = _admission(_trainer(**change.pop("_trainer", {})))
    decision = admission.decide(_engine(**change))
    assert not decision.accepted and decision.fatal
    assert words in decision.reason, decision.reason
    assert "set " in decision.reason and "alike on both jobs" in decision.reason
    assert admission.failure == decision.reason and not admission.complete


MODEL_CHANGES = [
    ({"rope_theta": 10000.0}, "rope_parameters.rope_theta: trainer 1000000.0, this inference job 10000.0"),
    ({"hidden_size": 128, "head_dim": 32}, "hidden_size: trainer 64, this inference job 128"),
    ({"vocab_size": 256}, "vocab_size: trainer 250, this inference job 256"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings: trainer False, this inference job True"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps: trainer 1e-06, this inference job 1e-05"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "quantization_config.quant_method: trainer None, this inference job 'fp8'"),
]


@pytest.mark.parametrize("change, words", MODEL_CHANGES, ids=[next(iter(c)) for c, _ in MODEL_CHANGES])
def test_a_model_that_differs_in_a_defining_field_is_refused_naming_the_field(change, words):
    decision = _admission().decide(_engine(model=change))
    assert not decision.accepted and decision.fatal
    assert f"the models differ in {words}" in decision.reason, decision.reason


# ---- the settings each transport's two halves share, from each job's own settings ----

SHARED_SETTINGS = [  # (transport, trainer's settings, inference job's settings, words of the refusal; None: admitted)
    ("broadcast", {"checksum": "xxh3"}, {"checksum": "crc32"},
     "trainer checks every bucket with 'xxh3', this inference job with 'crc32' (set weight_sync.checksum alike"),
    ("broadcast", {"checksum": "auto"}, {"checksum": "xxh3"}, None),  # auto is xxh3 for gloo's host buckets
    ("p2p", {"p2p_backend": "torch"}, {"p2p_backend": "mooncake"},
     "trainer moves P2P bytes with 'torch', this inference job with 'mooncake' (set weight_sync.p2p.backend alike"),
    ("p2p", {"p2p_backend": "mooncake", "p2p_protocol": "tcp"}, {"p2p_backend": "mooncake", "p2p_protocol": "rdma"},
     "trainer runs Mooncake over 'tcp', this inference job over 'rdma' (set weight_sync.p2p.protocol alike"),
    ("p2p", {"p2p_protocol": "tcp"}, {"p2p_protocol": "rdma"}, None),  # the torch mover has no protocol
    ("p2p", {"checksum": "xxh3"}, {"checksum": "crc32"},
     "trainer checks every bucket with 'xxh3', this inference job with 'crc32' (set weight_sync.checksum alike"),
    ("p2p", {"bucket_size_mb": 1.0}, {"bucket_size_mb": 2.0},
     "trainer cuts buckets of 1.0 MiB, this inference job expects 2.0 (set weight_sync.bucket_size_mb alike"),
]


@pytest.mark.parametrize("transport, trainer, engine, words", SHARED_SETTINGS)
def test_each_transport_compares_the_settings_its_halves_share(transport, trainer, engine, words):
    from megatron_sync.transports import get_transport

    shares = get_transport(transport).shares

    def identity(role: str, changes: dict) -> Identity:
        config = CONFIG.replace(transport=transport, **changes)
        return Identity(job=role, role=role, member=0, session="S", model=model_fields(QWEN3),
                        expects=expectations(config, trainer_stages=1, backend="gloo", shares=shares))

    decision = _admission(identity("trainer", trainer)).decide(identity("inference", engine))
    if words is None:
        assert decision.accepted, decision.reason
    else:
        assert not decision.accepted and decision.fatal and words in decision.reason, decision.reason


# ---- who is admitted ----

def test_a_whole_job_is_admitted_and_completes_the_session():
    admission = _admission()
    assert [admission.decide(_engine(m)).accepted for m in (1, 0)] == [True, True]
    assert admission.complete and admission.failure is None
    assert admission.admitted == {"trainer": {0: "T"}, "inference": {0: "E", 1: "E"}}


def test_a_second_job_is_refused_by_session_name_and_the_first_is_undisturbed():
    admission = _admission()
    assert admission.decide(_engine(0, job="E")).accepted
    second = [admission.decide(_engine(m, job="E2")) for m in (0, 1)]
    assert all(not d.accepted and not d.fatal for d in second)
    assert "session 'S' already has inference job 'E' (1 of 2 inference ranks joined)" in second[0].reason
    assert "this inference job 'E2' is refused" in second[0].reason
    assert admission.decide(_engine(1, job="E")).accepted and admission.complete and admission.failure is None
    late = admission.decide(_engine(0, job="E3", num_inference_ranks=1))  # a late, different job: also refused
    assert not late.fatal and "already has inference job 'E' (2 of 2" in late.reason


REFUSALS = [  # (joiner, words, fatal)
    (_engine(2), "session 'S' needs 2 inference ranks (0..1); this is inference rank 2", True),
    (Identity(job="E", role="critic", member=0), "session 'S' has no 'critic' ranks", False),
    (Identity(job="E", role="inference", member=0, session="other"),
     "this job asked for session 'other', but the rendezvous runs session 'S'; give both jobs the same "
     "weight_sync.run_id", False),
    (Identity(job="E", role="inference", member=1, failure="ValueError: engine_tp_size=3 does not divide 4 heads"),
     "inference rank 1 of job 'E' failed while starting: ValueError: engine_tp_size=3 does not divide 4 heads", True),
]


@pytest.mark.parametrize("joiner, words, fatal", REFUSALS, ids=["beyond-count", "role", "session", "failure"])
def test_refusals_name_the_reason(joiner, words, fatal):
    admission = _admission()
    decision = admission.decide(joiner)
    assert not decision.accepted and decision.fatal == fatal
    assert words in decision.reason, decision.reason
    assert (admission.failure is not None) == fatal


def test_once_failed_every_later_joiner_is_told_why():
    admission = _admission()
    admission.decide(_engine(0, num_inference_ranks=1))
    later = admission.decide(_engine(1))
    assert not later.accepted and later.reason.startswith("session 'S' has failed: inference rank 0 of job 'E'")


def test_after_a_failure_the_host_knows_when_every_rank_was_told():
    admission = _admission()
    assert not admission.all_presented  # the trainer is the host; both inference ranks are still to come
    admission.failure = "the trainer failed while starting: ValueError: rotary base differs"
    assert not admission.decide(_engine(1)).accepted and not admission.all_presented
    admission.decide(_engine(0, job="E2"))  # a second job's rank does not count for the first
    assert not admission.all_presented
    assert not admission.decide(_engine(0)).accepted and admission.all_presented


def test_a_failure_report_from_a_second_job_does_not_fail_the_session():
    admission = _admission()
    assert admission.decide(_engine(0)).accepted
    report = admission.decide(Identity(job="E2", role="inference", member=0, failure="boom"))
    assert not report.fatal and admission.failure is None


def test_a_taken_rank_is_refused():
    admission = _admission()
    assert admission.decide(_engine(0)).accepted
    again = admission.decide(_engine(0))
    assert not again.accepted and "inference rank 0 of session 'S' was already taken by job 'E'" in again.reason


def test_identity_and_decision_travel_as_json():
    engine = _engine(1)
    assert Identity.from_json(engine.to_json()) == engine


# ---- the model digest ----

@pytest.mark.parametrize("change", [
    {"rope_theta": 10000.0}, {"hidden_size": 128}, {"vocab_size": 256}, {"tie_word_embeddings": True},
    {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
    {"rms_norm_eps": 1e-5}, {"num_key_value_heads": 4}, {"model_type": "qwen2"},
], ids=lambda c: next(iter(c)))
def test_a_defining_field_changes_the_digest(change):
    assert model_digest(model_fields({**QWEN3, **change})) != model_digest(model_fields(QWEN3))


@pytest.mark.parametrize("change", [
    {"_name_or_path": "/models/other"}, {"transformers_version": "4.0.0"}, {"use_cache": False},
    {"bos_token_id": 7}, {"architectures": ["Qwen3ForCausalLM"]}, {"torch_dtype": "bfloat16"},
    {"max_position_embeddings": 4096},
], ids=lambda c: next(iter(c)))
def test_bookkeeping_fields_do_not_change_the_digest(change):
    assert model_digest(model_fields({**QWEN3, **change})) == model_digest(model_fields(QWEN3))


@pytest.mark.parametrize("model_type, change", [
    ("gpt_oss", {"swiglu_limit": 5.0}), ("gpt_oss", {"sliding_window": 64}),
    ("gpt_oss", {"layer_types": ["full_attention", "sliding_attention"]}),
    ("qwen3_next", {"layer_types": ["full_attention", "linear_attention"]}),
    ("qwen3_next", {"linear_num_value_heads": 8}), ("qwen3_next", {"shared_expert_intermediate_size": 64}),
], ids=lambda c: c if isinstance(c, str) else next(iter(c)))
def test_a_layer_kind_field_changes_the_digest(model_type, change):
    base = {"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 250}
    assert model_digest(model_fields({**base, **change})) != model_digest(model_fields(base))


def test_a_config_json_and_the_loaded_config_give_the_same_fields():
    from transformers import AutoConfig

    loaded = AutoConfig.for_model(**QWEN3)
    assert model_fields(QWEN3) == model_fields(loaded)
    assert model_fields(QWEN3)["rope_parameters.rope_theta"] == 1000000.0  # old-style key, new-style field
    assert {name.split(".")[0] for name in model_fields(loaded)} <= set(defining_field_names())


# ---- the session secret ----

SECRETS = {"A": SessionSecret("correct-horse-battery"), "B": SessionSecret("another-horse-entirely")}
SECRET_VALUES = ("correct-horse-battery", "another-horse-entirely")

SECRET_CASES = [  # (the host's secret, the joiner's, words of the refusal; None: admitted)
    ("A", "A", None),
    (None, None, None),
    ("A", None, "inference rank 0 of job 'E' presents no session secret, but session 'S' requires one: set "
                "MEGATRON_SYNC_SECRET in this job's environment to the trainer's"),
    ("A", "B", "inference rank 0 of job 'E' presents another session secret than session 'S''s: set "
               "MEGATRON_SYNC_SECRET to the same value on both jobs"),
    (None, "A", "inference rank 0 of job 'E' presents a session secret, but session 'S' runs without one: set "
                "MEGATRON_SYNC_SECRET on the trainer too (the same value), or on neither job"),
]


def _secret_admission(host_secret) -> Admission:
    secret = SECRETS.get(host_secret)
    return Admission("S", signed(_trainer(), secret), {"trainer": 1, "inference": 2}, secret=secret)


@pytest.mark.parametrize("host, joiner, words", SECRET_CASES, ids=["same", "neither", "missing", "another",
                                                                    "host-has-none"])
def test_a_joiner_without_the_session_secret_is_refused_by_name_and_the_session_is_untouched(host, joiner, words):
    admission = _secret_admission(host)
    presented = signed(_engine(0), SECRETS.get(joiner), admission.host)
    decision = admission.decide(presented)
    if words is None:
        assert decision.accepted, decision.reason
        return
    assert not decision.accepted and not decision.fatal and decision.reason == words, decision.reason
    assert admission.failure is None and admission.presented == {} and admission.admitted == {"trainer": {0: "T"}}
    rightful = signed(_engine(0, job="E2"), SECRETS.get(host), admission.host)  # the session goes on
    assert admission.decide(rightful).accepted and admission.job_of("inference") == "E2"


def test_a_proof_covers_the_whole_identity_and_never_shows_the_secret():
    admission = _secret_admission("A")
    presented = signed(_engine(1), SECRETS["A"], admission.host)
    replayed = dataclasses.replace(presented, member=0)  # the same proof under another rank: refused
    assert "presents another session secret" in admission.decide(replayed).reason
    forged = dataclasses.replace(presented, failure="forged: the trainer must stop")  # a report needs its own proof
    assert not admission.decide(forged).fatal and admission.failure is None
    assert admission.decide(presented).accepted
    shown = " ".join([repr(admission), str(SECRETS["A"]), presented.describe(), presented.to_json().decode(),
                      admission.host.to_json().decode()])
    assert not any(value in shown for value in SECRET_VALUES), shown
    with pytest.raises(TypeError, match="not pickled"):
        pickle.dumps(SECRETS["A"])


@pytest.mark.parametrize("host, joiner, words", [
    ("A", "A", None), (None, None, None), ("A", None, None),  # a joiner without a secret: the host says why
    ("B", "A", "proves another session secret than this job's: set MEGATRON_SYNC_SECRET to the same value"),
    (None, "A", "runs session 'S' without a session secret, but this job has MEGATRON_SYNC_SECRET set"),
], ids=["same", "neither", "joiner-has-none", "another", "host-has-none"])
def test_a_joiner_with_a_secret_checks_that_the_host_proves_it(host, joiner, words):
    problem = host_unproven(signed(_trainer(), SECRETS.get(host)), SECRETS.get(joiner), "h:1")
    assert problem == words if words is None else words in problem, problem


def test_the_secret_is_read_from_its_environment_variable_only():
    assert SessionSecret.from_environment({}) is None and SessionSecret.from_environment({SECRET_ENV: ""}) is None
    read = SessionSecret.from_environment({SECRET_ENV: "correct-horse-battery"})
    assert read.proof("x") == SECRETS["A"].proof("x") != SECRETS["B"].proof("x")


# ---- a fleet: one live job per engine id ----

def _fleet_admission() -> Admission:
    return Admission("S", _trainer(), {"trainer": 1}, engine_ranks=2)


def _engine_rank(job: str, member: int, engine: int = 0) -> Identity:
    return dataclasses.replace(_engine(member, job=job), engine=engine)


def test_an_engine_id_held_by_a_live_job_is_refused_and_a_gone_one_is_superseded():
    admission = _fleet_admission()
    assert all(admission.decide(_engine_rank("J1", m)).accepted for m in (0, 1))
    assert admission.contested(_engine_rank("J1", 0)) is None  # its own job: nothing to ask
    seat = admission.contested(_engine_rank("J2", 0))
    assert seat is not None and (seat.job, seat.generation, seat.ranks) == ("J1", 0, {0, 1})
    duplicate = admission.decide(_engine_rank("J2", 0), holder_alive=True)
    assert not duplicate.accepted and not duplicate.fatal
    assert duplicate.reason == ("engine 0 of session 'S' is held by job 'J1' (generation 0), which still answers; "
                                "this job 'J2' presenting the same engine id is refused: give each engine its own "
                                "weight_sync.engine_id (a restarted engine is admitted once its earlier job is gone)")
    assert admission.complete_engines() == {0: (0, "J1")}  # the live engine keeps its seat
    restarted = [admission.decide(_engine_rank("J3", m), holder_alive=False) for m in (0, 1)]
    assert all(d.accepted and d.generation == 1 for d in restarted)
    assert admission.complete_engines() == {0: (1, "J3")}
    assert "was superseded" in admission.decide(_engine_rank("J1", 0)).reason
    assert admission.contested(_engine_rank("J4", 0, engine=1)) is None  # an engine id nobody holds
