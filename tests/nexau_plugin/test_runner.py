"""nexrl's agent runner: the agent loop, safe tools, why a run ends, and the trace it records."""

from __future__ import annotations

import importlib
import time

import pytest

from nexrl_core import ConfigError, SamplingParams
from nexrl_nexau import AgentRunner, load_agent_spec
from nexrl_nexau.tools import abandoned_tool_threads

from .scripted import ScriptedChat, decode, tool_call


def params(**kw):
    return SamplingParams(**{"max_tokens": 2000, "temperature": 1.0, "seed": 5, **kw})


def run(path, policy, **runner_kw):
    runner = AgentRunner(load_agent_spec(path), **runner_kw)
    client = ScriptedChat(policy)
    return runner.run("What is 2 + 3?", lambda m, t, p: client.chat(m, p, t), params()), client


def test_answers_after_a_tool_call_and_records_the_nexau_trace_shape(agent_factory):
    path = agent_factory(["add"])

    def policy(messages, tools):
        if messages[-1]["role"] == "user":
            return "Let me add.", [tool_call("add", {"a": 2, "b": 3}, "c1")]
        return f"The answer is {messages[-1]['content']}."

    result, client = run(path, policy)
    assert (result.stop_reason, result.final_answer) == ("answered", "The answer is 5.")
    assert [m["role"] for m in result.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert result.messages[3] == {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "5"}
    # structured mode: the model got the tool schemas (name from the agent entry, schema from the tool YAML)
    schema = client.requests[0]["tools"][0]
    assert schema["function"]["name"] == "add" and schema["function"]["parameters"]["required"] == ["a", "b"]
    (root,) = result.trace
    assert root["type"] == "AGENT" and root["outputs"] == {"response": "The answer is 5."}
    assert root["attributes"]["stop_reason"] == "answered"
    assert [c["type"] for c in root["children"]] == ["LLM", "TOOL", "LLM"]
    llm, tool, _ = root["children"]
    assert llm["inputs"]["messages"] == result.messages[:2] and llm["inputs"]["tools"] == client.requests[0]["tools"]
    assert llm["inputs"]["temperature"] == 1.0 and llm["inputs"]["seed"] == 5
    choice = llm["outputs"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["id"] == "c1"
    assert decode(llm["outputs"]["nexrl_train"]["response_tokens"]) == "Let me add.<|im_end|>"
    assert tool["inputs"] == {"parameters": {"a": 2, "b": 3}, "tool_call_id": "c1"}
    assert tool["outputs"] == {"result": "5"} and tool["error"] is None
    # each model call of a run samples with its own seed
    seeds = [r["params"].seed for r in client.requests]
    assert seeds[0] == 5 and seeds[1] != 5


def test_parallel_tool_calls_run_concurrently_and_answer_in_order(agent_factory):
    path = agent_factory(["add", "slow_echo"])

    def policy(messages, tools):
        if messages[-1]["role"] == "user":
            return "", [tool_call("add", {"a": 1, "b": 1}, "x"), tool_call("slow_echo", {"text": "hi"}, "y")]
        return "done"

    result, _ = run(path, policy)
    tool_msgs = [m for m in result.messages if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tool_msgs] == [("x", "2"), ("y", "HI")]  # async tool too
    assert result.num_tool_calls == 2 and result.num_tool_errors == 0


@pytest.mark.parametrize("tool,args,expect,kind", [
    ("explode", {"text": "x"}, "Error: tool 'explode' failed: RuntimeError: boom: x", "exception"),
    ("garbage", {"text": "x"}, "Error: tool 'garbage' returned a value of type object that is neither text nor JSON",
     "bad_output"),
    ("add", {"a": 1}, "Error: invalid arguments for 'add': missing required argument 'b'", "bad_arguments"),
    ("add", {"a": "1", "b": 2}, "Error: invalid arguments for 'add': argument 'a' must be number, got string",
     "bad_arguments"),
    ("add", {"a": 1, "b": 2, "c": 3}, "Error: invalid arguments for 'add': unknown argument 'c'", "bad_arguments"),
    ("add", "{not json", "Error: the arguments of your call to 'add' could not be read: arguments are not valid JSON",
     "bad_arguments"),
    ("subtract", {"a": 1}, "Error: there is no tool named 'subtract' (available tools: add, explode, garbage",
     "unknown_tool"),
    ("nexau_error", {"text": "q"}, '{"error": "not found: q"}', "exception"),
])
def test_a_failing_tool_call_becomes_a_message_the_agent_sees(agent_factory, tool, args, expect, kind):
    path = agent_factory(["add", "explode", "garbage", "nexau_error"])

    def policy(messages, tools):
        if messages[-1]["role"] == "user":
            return "", [tool_call(tool, args, "c")]
        return "gave up"

    result, _ = run(path, policy)
    tool_msg = next(m for m in result.messages if m["role"] == "tool")
    assert tool_msg["content"].startswith(expect)
    assert result.stop_reason == "answered" and result.tool_errors == {kind: 1}
    tool_span = result.trace[0]["children"][1]
    assert tool_span["type"] == "TOOL" and tool_span["error"].startswith(expect)


def test_a_tool_that_hangs_is_cut_off_at_its_timeout(agent_factory):
    path = agent_factory(["hang", "echo"])
    AgentRunner(load_agent_spec(path))  # imports the tool module (its folder goes on sys.path)
    module = importlib.import_module(load_agent_spec(path).tools[0].binding.split(":")[0])

    def policy(messages, tools):
        if messages[-1]["role"] == "user":
            return "", [tool_call("hang", {"text": "x"}, "h"), tool_call("echo", {"text": "ok"}, "e")]
        return "moved on"

    before = abandoned_tool_threads()
    t0 = time.monotonic()
    try:
        result, _ = run(path, policy, tool_timeout=0.3)
        elapsed = time.monotonic() - t0
        contents = [m["content"] for m in result.messages if m["role"] == "tool"]
        assert contents == ["Error: tool 'hang' did not finish within 0.3 seconds", "ok"]
        assert result.stop_reason == "answered" and result.tool_errors == {"timeout": 1}
        assert elapsed < 5  # the run did not wait for the tool
        assert abandoned_tool_threads() == before + 1
    finally:
        module.RELEASE.set()
    deadline = time.monotonic() + 5
    while abandoned_tool_threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert abandoned_tool_threads() == before  # the released thread finished and is no longer counted


def test_huge_tool_output_is_cut_with_a_note(agent_factory):
    path = agent_factory(["huge"])

    def policy(messages, tools):
        return ("", [tool_call("huge", {"text": "x"})]) if messages[-1]["role"] == "user" else "ok"

    result, _ = run(path, policy, max_tool_output_chars=100)
    content = next(m for m in result.messages if m["role"] == "tool")["content"]
    assert content == "y" * 100 + "\n[... 99900 more characters cut]"


def test_max_iterations_ends_a_looping_agent(agent_factory):
    path = agent_factory(["echo"], max_iterations=3)
    result, client = run(path, lambda m, t: ("again", [tool_call("echo", {"text": "loop"})]))
    assert result.stop_reason == "max_iterations" and result.final_answer == ""
    assert result.num_llm_calls == 3 == len(client.requests) and result.num_tool_calls == 3
    assert result.trace[0]["attributes"]["stop_reason"] == "max_iterations"


def test_a_reply_cut_at_max_tokens_ends_the_run_truncated_without_running_its_calls(agent_factory):
    path = agent_factory(["echo"])
    runner = AgentRunner(load_agent_spec(path))
    client = ScriptedChat(lambda m, t: ("x" * 50, [tool_call("echo", {"text": "never"})]))
    result = runner.run("q", lambda m, t, p: client.chat(m, p, t), params(max_tokens=10))
    assert result.stop_reason == "truncated" and result.num_tool_calls == 0
    assert result.trace[0]["children"][0]["outputs"]["choices"][0]["finish_reason"] == "length"


def test_a_full_context_ends_the_run_truncated(agent_factory):
    path = agent_factory(["echo"], max_context_tokens=120)
    result, client = run(path, lambda m, t: ("", [tool_call("echo", {"text": "a" * 30})]))
    assert result.stop_reason == "truncated"
    last = result.trace[0]["children"][-1]["outputs"]["usage"]
    assert last["total_tokens"] >= 120


def test_a_stop_tool_ends_the_run_with_its_result(agent_factory):
    path = agent_factory(["echo", "add"], stop_tools=["echo"])

    def policy(messages, tools):
        if messages[-1]["role"] == "user":
            return "", [tool_call("add", {"a": 1, "b": 2})]
        return "", [tool_call("echo", {"text": "final: 3"})]

    result, client = run(path, policy)
    assert (result.stop_reason, result.final_answer, len(client.requests)) == ("answered", "final: 3", 2)


def test_an_inference_failure_ends_the_run_with_error(agent_factory):
    path = agent_factory(["echo"])
    runner = AgentRunner(load_agent_spec(path))

    def broken(messages, tools, p):
        raise RuntimeError("server gone")

    result = runner.run("q", broken, params())
    assert result.stop_reason == "error" and "server gone" in result.error
    assert result.trace[0]["children"][0]["error"] == "RuntimeError: server gone"


def test_xml_mode_describes_tools_in_the_prompt_and_parses_xml_calls(agent_factory):
    path = agent_factory(["add", "echo"], tool_call_mode="xml")

    def policy(messages, tools):
        assert tools is None  # xml mode: no tool schemas in the request
        if messages[-1]["role"] == "user" and "<tool_result>" not in messages[-1]["content"]:
            return ("<use_parallel_tool_calls><parallel_tool><tool_name>add</tool_name><parameter><a>2</a>"
                    "<b>2.5</b></parameter></parallel_tool><parallel_tool><tool_name>add</tool_name><parameter>"
                    "<a>two</a><b>1</b></parameter></parallel_tool></use_parallel_tool_calls>")
        return "4.5"

    result, client = run(path, policy)
    system = client.requests[0]["messages"][0]["content"]
    assert system.startswith("You are a test agent.") and "<tool_name>add</tool_name>" in system
    results = result.messages[3]
    assert results["role"] == "user" and "<result>\n4.5\n</result>" in results["content"]
    assert "parameter 'a' should be number" in results["content"]
    assert result.final_answer == "4.5" and result.tool_errors == {"bad_arguments": 1}


def test_binding_by_file_path_and_lazy_binding_errors(tmp_path):
    (tmp_path / "impl").mkdir()
    (tmp_path / "impl" / "my_tools.py").write_text("def shout(text):\n    return text.upper() + '!'\n")
    (tmp_path / "t.yaml").write_text("name: Shout\ndescription: d\ninput_schema: {type: object, properties: "
                                     "{text: {type: string}}}\n")
    (tmp_path / "agent.yaml").write_text(
        "type: agent\nname: a\ntools:\n"
        "  - {name: shout, yaml_path: t.yaml, binding: impl/my_tools.py:shout}\n"
        "  - {name: ghost, yaml_path: t.yaml, binding: no_such_module_xyz:fn, lazy: true}\n")
    runner = AgentRunner(load_agent_spec(str(tmp_path / "agent.yaml")))
    client = ScriptedChat(lambda m, t: ("", [tool_call("shout", {"text": "hi"}, "s"), tool_call("ghost", {"text": "x"},
                                                                                                 "g")])
                          if m[-1]["role"] == "user" else "ok")
    result = runner.run("q", lambda m, t, p: client.chat(m, p, t), params())
    contents = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert contents[0] == "HI!"
    assert contents[1].startswith("Error: tool 'ghost' is unavailable:") and "no_such_module_xyz" in contents[1]


@pytest.mark.parametrize("agent,tool,message", [
    ("name: a\nbogus: 1\n", None, "agent.yaml: unknown key(s) bogus"),
    ("name: a\nsub_agents: []\n", None, "sub_agents: not supported by nexrl's built-in agent runner"),
    ("name: a\ntool_call_mode: json\n", None, "tool_call_mode: expected one of"),
    ("name: a\nmax_iterations: 0\n", None, "max_iterations: expected an integer >= 1, got 0"),
    ("name: a\nllm_config: {temprature: 1}\n", None, "llm_config: unknown key(s) temprature"),
    ("name: a\ntools: [{name: t, yaml_path: t.yaml}]\n", "name: T\ndescription: d\n",
     "tools[0] (t): binding: required"),
    ("name: a\ntools: [{name: t, yaml_path: missing.yaml, binding: m:f}]\n", None, "missing.yaml not found"),
    ("name: a\ntools: [{name: t, yaml_path: t.yaml, binding: m:f, as_skill: true}]\n", "name: T\ndescription: d\n",
     "tools[0]: as_skill: not supported by nexrl's built-in agent runner; run this agent with NexAU itself"),
    ("name: a\ntools: [{name: t, yaml_path: t.yaml, binding: m:f}]\n", "name: T\ndescription: d\nbuiltin: x\n",
     "t.yaml: builtin: not supported"),
    ("name: a\ntools: [{name: t, yaml_path: t.yaml, binding: m:f}]\n", "name: T\ndescription: [d\n",
     "t.yaml:3: not valid YAML"),
    ("name: a\nstop_tools: [nope]\n", None, "stop_tools: nope is not one of the agent's tools"),
    ("name: a\nsystem_prompt: '{{ x'\nsystem_prompt_type: jinja\n", None, "not a valid jinja template"),
])
def test_bad_agent_files_name_the_file_and_key(tmp_path, agent, tool, message):
    (tmp_path / "agent.yaml").write_text(agent)
    if tool is not None:
        (tmp_path / "t.yaml").write_text(tool)
    with pytest.raises(ConfigError, match=None) as info:
        load_agent_spec(str(tmp_path / "agent.yaml"))
    assert message in str(info.value)


def test_jinja_system_prompt_is_rendered_with_the_task(tmp_path):
    (tmp_path / "agent.yaml").write_text("name: a\nsystem_prompt_type: jinja\n"
                                         "system_prompt: 'Topic: {{ topic }}. Today is {{ date }}.'\n")
    runner = AgentRunner(load_agent_spec(str(tmp_path / "agent.yaml")))
    prompt = runner.system_prompt({"topic": "sums"})
    assert prompt.startswith("Topic: sums. Today is 20")


def test_a_call_the_backend_could_not_read_is_reported_to_the_agent(agent_factory):
    from nexrl_core.tool_calls import parse_tool_calls

    path = agent_factory(["add"])
    _, broken = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>'
                                 '<tool_call>no json at all</tool_call>')

    def policy(messages, tools):
        return ("", broken) if messages[-1]["role"] == "user" else "sorry"

    result, _ = run(path, policy)
    first, second = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert first.startswith("Error: the arguments of your call to 'add' could not be read: the tool call is not a "
                            "JSON object")
    assert second.startswith("Error: your tool call could not be read:")
    assert result.tool_errors == {"bad_arguments": 2}
