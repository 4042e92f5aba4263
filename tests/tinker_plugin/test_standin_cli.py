"""``python -m nexrl_tinker.standin`` as a recipe author runs it: a subprocess serving an HF folder."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import tinker
from tinker import types

from tests.tinker_plugin.helpers import API_KEY


def test_the_module_serves_a_model_folder_to_the_sdk(tiny_folder, tmp_path, tokenizer):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "nexrl_tinker.standin", "--model", f"smol={tiny_folder}",
                             "--port", "0", "--state-dir", str(tmp_path / "state"), "--threads", "1",
                             "--try-again-polls", "1", "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "Tinker stand-in serving smol at http://127.0.0.1:" in line, (line, proc.stderr.read())
        url = line.split(" at ")[1].split()[0]
        client = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        try:
            training = client.create_lora_training_client(base_model="smol", rank=2, seed=0).result()
            path = training.save_weights_for_sampler("s1").result().path
            sampler = client.create_sampling_client(model_path=path).result()
            ids = tokenizer("the quick").input_ids
            out = sampler.sample(types.ModelInput.from_ints(ids), 2,
                                 types.SamplingParams(max_tokens=3, temperature=1.0, seed=0, stop=[])).result()
        finally:
            client.close("success").result(timeout=30)
        assert [len(s.tokens) for s in out.sequences] == [3, 3]
        assert sampler.get_base_model() == "smol"
        assert (tmp_path / "state" / training.model_id / "sampler_weights" / "s1" / "weights.safetensors").is_file()
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_bad_arguments_are_reported(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "nexrl_tinker.standin", "--model", f"m={tmp_path}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "is not a model folder (no config.json)" in proc.stderr
    from nexrl_tinker.standin import Fault

    with pytest.raises(ValueError, match="PATH:NTH:ACTION"):
        Fault.parse("forward_backward:x")
    assert Fault.parse("asample:2:429:3") == Fault("asample", 2, 429, 3)
    assert Fault.parse("*:1:hang").action == "hang"
