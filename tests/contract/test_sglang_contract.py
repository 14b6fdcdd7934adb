"""Contract: what the SGLang client sends and what the CPU server answers, checked against the
pinned sglang release's own schema files (not a hand copy).

- ``sglang/api/v1/api_types.py`` (imports only msgspec) is loaded by path from the wheel:
  every /generate body must decode as ``GenerateRequest`` (its ``SamplingParams`` rejects an
  unknown key, as the server answers 400) and use only known top-level keys (``GenerateRequest``
  itself ignores unknown ones, so that is checked by name); every CPU-server answer must decode
  as ``GenerateResponse`` / ``GetModelInfoResponse`` with known keys only and a typed finish reason.
- ``sglang/srt/managers/io_struct.py`` imports half of sglang, so its request classes are read
  with ``ast``: each control body may use only the class's fields (plus ``BaseReq``'s) and must
  carry its required ones; pause modes must be values of its ``Literal``.

The bodies are the ones the client really sent: ``call`` is wrapped to record traffic while the
client drives a real CPU server (generate, pause, weights over gloo and from disk, abort).
"""

from __future__ import annotations

import ast
import importlib.util
import sys

import pytest
import torch

from areal_async.config import load_config
from areal_async.models.tiny import build_model
from areal_async.rollout.clients import http_client as HC  # every client request goes through HC.call
from areal_async.rollout.clients import sglang_client as SC
from areal_async.rollout.engines.engine import GenRequest
from areal_async.models.tokenizer import load_tokenizer
from areal_async.models.lora import LoraSpec, adapter_shapes
from areal_async.models.tiny import save_policy
from areal_async.rollout.clients.http_json import HTTPStatusError
from areal_async.config import LoraConfig
from areal_async.supervisor.servers import sglang_lora_args
from tests.support.sglang_fixtures import SGLANG_PIN, TINY, pinned_sglang_file, start_cpu_server, stop

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    pytest.importorskip("msgspec", reason="the schema file imports msgspec (pip install -e '.[test]')")
    path = tmp_path_factory.mktemp("sglang") / "api_types.py"
    path.write_text(pinned_sglang_file("sglang/api/v1/api_types.py"))
    spec = importlib.util.spec_from_file_location("sglang_api_types_pinned", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # msgspec resolves the string annotations through the module
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def io_struct():
    """{class name: (fields, required fields, annotations as source)} of io_struct.py."""
    tree = ast.parse(pinned_sglang_file("sglang/srt/managers/io_struct.py"))
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            fields = {
                s.target.id: (s.value is not None, ast.unparse(s.annotation))
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
            out[node.name] = fields
    return out


def _recorded(drive, extra: list[str] = ()) -> list:
    """(path, body, answer) of every call ``drive(url)`` made to a real CPU server started with ``extra``."""
    proc, url = start_cpu_server(extra=extra)
    log = []
    real = HC.call

    def recording(base, method, path, body=None, timeout_s=30.0):
        out = real(base, method, path, body, timeout_s)
        log.append((path, body, out))
        return out

    HC.call = recording
    try:
        drive(url)
    finally:
        HC.call = real
        stop(proc)
    return log


@pytest.fixture(scope="module")
def traffic(tmp_path_factory):
    """(path, body, answer) of every call a client made to a real CPU server."""
    return _recorded(lambda url: _drive(url, tmp_dir=str(tmp_path_factory.mktemp("disk"))))


def _drive(url: str, tmp_dir: str) -> None:
    cfg = load_config(TINY)
    tok = load_tokenizer(cfg.model.path)
    sd = build_model(cfg.model, len(tok), 3).state_dict()
    c = SC.SGLangClient(url, name="contract", weight_update_session=True)
    c.wait_ready(120)
    c.pause()
    c.update_weights(0, sd)
    c.resume()
    prompt = tok.encode("1+2=")
    c.generate("r-sample", prompt, 6, GenRequest("g", prompt, 1, 6, temperature=0.7, top_p=0.9, stop_token_ids=(5,)))
    c.generate("r-greedy", prompt, 6, GenRequest("g", prompt, 1, 6, greedy=True))
    c.abort_all()
    d = SC.SGLangClient(url, name="contract-disk", weight_sync="disk", disk_dir=tmp_dir)
    d.update_weights(1, sd)


def _known_keys(obj: dict, struct, where: str) -> None:
    unknown = set(obj) - set(struct.__struct_fields__)
    assert not unknown, f"{where}: keys {sorted(unknown)} are not fields of sglang {SGLANG_PIN} {struct.__name__}"


def test_every_generate_body_decodes_as_the_pinned_generate_request(api, traffic):
    bodies = [b for p, b, _ in traffic if p == "/generate"]
    assert len(bodies) == 2
    for body in bodies:
        _known_keys(body, api.GenerateRequest, "/generate body")
        req = api.GenerateRequest.from_json_value(body)  # raises JsonContractError on a refused key/type
        assert req.return_logprob is True and req.input_ids == body["input_ids"]
        _known_keys(body["sampling_params"], api.SamplingParams, "sampling_params")
    greedy = [b for b in bodies if b["rid"] == "r-greedy"][0]["sampling_params"]
    assert greedy == {"max_new_tokens": 6, "temperature": 0.0}


def test_schema_refuses_what_sglang_would_refuse(api):
    """The check can fail: a sampling key SGLang does not know, or a wrongly typed field."""
    with pytest.raises(api.JsonContractError, match="unknown field `greedy`"):
        api.GenerateRequest.from_json_value({"input_ids": [1], "sampling_params": {"greedy": True}})
    with pytest.raises(api.JsonContractError):
        api.GenerateRequest.from_json_value({"input_ids": [1], "return_logprob": "yes"})


def test_every_cpu_server_generate_answer_decodes_as_the_pinned_response(api, traffic):
    answers = [a for p, _, a in traffic if p == "/generate"]
    for a in answers:
        _known_keys(a, api.GenerateResponse, "/generate answer")
        _known_keys(a["meta_info"], api.GenerateMetaInfo, "meta_info")
        r = api.GenerateResponse.from_json_value(a)
        m = r.meta_info
        assert isinstance(m.finish_reason, (api.FinishStop, api.FinishLength, api.FinishAbort)), m.finish_reason
        assert [e.token_id for e in m.output_token_logprobs] == list(r.output_ids)
        assert m.weight_version == "0" and [(s.version, s.start, s.end) for s in m.weight_versions] == [
            ("0", 0, len(r.output_ids))
        ]


def test_model_info_answer_decodes_and_reports_each_version(api, traffic):
    infos = [a for p, _, a in traffic if p == "/model_info"]
    assert [i["weight_version"] for i in infos] == ["0", "1"]  # after the gloo update, after the disk update
    for a in infos:
        _known_keys(a, api.GetModelInfoResponse, "/model_info answer")
        assert api.GetModelInfoResponse.from_json_value(a).is_generation is True


CONTROL = {
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/abort_request": "AbortReq",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
}


def test_every_control_body_uses_only_fields_of_the_pinned_io_struct_class(io_struct, traffic):
    base = io_struct["BaseReq"]
    seen = set()
    for path, body, _ in traffic:
        if path not in CONTROL:
            continue
        cls = io_struct[CONTROL[path]]
        fields = cls | base
        unknown = set(body) - set(fields)
        assert not unknown, f"{path}: {sorted(unknown)} are not fields of {CONTROL[path]} (sglang {SGLANG_PIN})"
        missing = [k for k, (has_default, _) in cls.items() if not has_default and k not in body]
        assert not missing, f"{path}: required fields {missing} of {CONTROL[path]} not sent"
        seen.add(path)
    assert seen == set(CONTROL), f"never exercised: {set(CONTROL) - seen}"


def test_pause_modes_and_dtypes_are_values_sglang_takes(io_struct, traffic):
    modes = ast.literal_eval(io_struct["PauseGenerationReqInput"]["mode"][1].removeprefix("Literal"))
    assert set(SC.PAUSE_MODES) == set(modes)
    for path, body, _ in traffic:
        if path == "/update_weights_from_distributed":
            assert body["load_format"] == "flattened_bucket"
            for d in body["dtypes"]:  # the server does getattr(torch, dtype)
                assert not d.startswith("torch.") and isinstance(getattr(torch, d), torch.dtype)


# ---- LoRA: the base from disk once, then adapters by name (rollout/clients/sglang_lora.py) -------------------------

LORA = LoraSpec(8, 16.0, ("q_proj", "v_proj", "down_proj"))
LORA_CONTROL = {
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA client's traffic to a CPU server launched with SGLang's LoRA flags, and what it checked."""
    tmp = tmp_path_factory.mktemp("lora")
    cfg = load_config(TINY)
    tok = load_tokenizer(cfg.model.path)
    base = build_model(cfg.model, len(tok), 3)
    save_policy(base, tok, tmp / "base")
    g = torch.Generator().manual_seed(0)
    adapters = [{k: torch.randn(s, generator=g) * 0.2 for k, s in adapter_shapes(base, LORA).items()} for _ in "ab"]
    prompt = tok.encode("1+2=")
    got: list = []

    def drive(url: str) -> None:
        c = SC.SGLangClient(url, name="lora", lora=LORA, lora_base=str(tmp / "base"), disk_dir=str(tmp / "disk"))
        c.wait_ready(120)
        for version, sd in enumerate(adapters):
            c.pause()
            c.update_weights(version, sd)
            c.resume()
            got.append(c.generate(f"r{version}", prompt, 6, GenRequest("g", prompt, 1, 6, greedy=True)))
        with pytest.raises(HTTPStatusError, match="serves 'v1' only"):
            HC.call(url, "POST", "/generate", {"input_ids": prompt, "lora_path": "v0", "sampling_params": {}})

    flags = sglang_lora_args(LoraConfig(rank=LORA.rank, alpha=LORA.alpha, target_modules=list(LORA.target_modules)))
    log = _recorded(drive, extra=flags)  # the twin launched as the supervisor launches it
    return log, got, base, adapters, prompt


def test_lora_bodies_use_only_fields_of_the_pinned_io_struct_classes(io_struct, api, lora_run):
    log = lora_run[0]
    base, seen = io_struct["BaseReq"], set()
    for path, body, _ in log:
        if path in LORA_CONTROL:
            cls = io_struct[LORA_CONTROL[path]]
            assert not set(body) - set(cls | base), f"{path}: {sorted(set(body) - set(cls | base))} not in {cls}"
            assert not [k for k, (has_default, _) in cls.items() if not has_default and k not in body], path
            seen.add(path)
    assert seen == set(LORA_CONTROL)
    assert [b["lora_name"] for p, b, _ in log if p == "/load_lora_adapter"] == ["v0", "v1"]
    assert [b["lora_name"] for p, b, _ in log if p == "/unload_lora_adapter"] == ["v0"]
    assert [p for p, _, _ in log].count("/update_weights_from_disk") == 1  # the base once
    generate = [b for p, b, _ in log if p == "/generate"]
    for body in generate:
        _known_keys(body, api.GenerateRequest, "/generate body")
        api.GenerateRequest.from_json_value(body)
    assert [b["lora_path"] for b in generate] == ["v0", "v1"]  # (the refused one raised before it was logged)


def test_the_served_adapter_is_the_one_loaded(lora_run):
    """Each version's greedy tokens and logprobs equal an HF forward of base + s B A (merged by hand here)."""
    _, got, base, adapters, prompt = lora_run
    for version, (sd, out) in enumerate(zip(adapters, got)):
        model = build_model(load_config(TINY).model, base.config.vocab_size, 3)
        with torch.no_grad():
            for layer in {k.rsplit(".lora_", 1)[0] for k in sd}:
                w = model.get_submodule(layer).weight
                w += LORA.scale * sd[layer + ".lora_B.weight"] @ sd[layer + ".lora_A.weight"]
            logits = model(torch.tensor([prompt + out.output_ids])).logits[0]
        logp = torch.log_softmax(logits.float(), -1)[len(prompt) - 1 : -1]
        want = logp.gather(1, torch.tensor(out.output_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-5, rtol=0)
        assert set(out.versions) == {version}
