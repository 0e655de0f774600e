"""The llama.cpp methods without llama.cpp: a stand-in ``llama-server`` (a Python script speaking the same HTTP
API) checks the process handling, the request (token ids in, no prompt cache), the speculative settings on the
server's command line (one server per setting), the parsing of its answer and counters, and that ``bench`` writes
the llama.cpp rows beside specdraft's. tests/engines/ runs the real one."""

import json
import sys

import pytest

from specdraft.bench.llamacpp import LlamaServer, completion_payload, find_binary, turn_result
from specdraft.bench.llamacpp_build import FORMAT, LLAMA_CPP_PYTHON_VERSION, machine, write_build_info
from specdraft.bench.llamacpp_spec import parse_speculation
from specdraft.bench.methods import TurnResult, parse_methods
from specdraft.cli import main
from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingConfig
from specdraft.sequence import GenerationConfig
from toys import save_tiny_checkpoint, tiny_tokenizer, write_target_gguf

FAKE_SERVER = r'''
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

args = sys.argv[1:]
port, drafting = int(args[args.index("--port") + 1]), "--spec-type" in args
n_max = int(args[args.index("--spec-draft-n-max") + 1]) if "--spec-draft-n-max" in args else 4
if "--fail" in open(args[args.index("-m") + 1], "rb").read(64).decode("latin-1"):
    print("error: failed to load model", flush=True)
    sys.exit(1)

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"status": "ok"})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        expected = os.environ.get("FAKE_CACHE_PROMPT")  # set by a test that checks it
        assert expected is None or req["cache_prompt"] is (expected == "1")
        assert req["return_tokens"] is True
        last, n = req["prompt"][-1], req["n_predict"]
        tokens = [(last + 1 + i) % 60 + 3 for i in range(n)]
        stop = "limit"
        if 2 in req["prompt"][-3:]:  # a prompt ending near </s>: answer 2 tokens, then end of sequence
            tokens, stop = tokens[:2] + [2], "eos"
        timings = {"prompt_n": len(req["prompt"]), "prompt_ms": 1.5, "predicted_n": len(tokens), "predicted_ms": 3.0}
        if drafting:
            timings |= {"draft_n": 2 * n_max, "draft_n_accepted": 3}
        self._send({"tokens": tokens, "content": "", "stop_type": stop, "timings": timings, "echo": req,
                    "args": args})

HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "llama-server"
    script.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    script.chmod(0o755)
    monkeypatch.setenv("SPECDRAFT_LLAMA_CPP_BIN", str(folder))
    return folder


def _gguf(path, tokens=None):
    return write_target_gguf(path, tokens or tiny_tokenizer().convert_ids_to_tokens(list(range(64))))


def test_a_missing_build_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_LLAMA_CPP_BIN", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SpecdraftError, match="make engines"):
        find_binary("llama-server")


def test_the_request_sends_token_ids_and_the_prompt_cache_as_asked():
    greedy = GenerationConfig(16, 4, eos_token_ids=(2,))
    payload = completion_payload([1, 5, 9], greedy, seed=7)
    assert payload["prompt"] == [1, 5, 9] and payload["n_predict"] == 16 and payload["temperature"] == 0.0
    assert payload["cache_prompt"] is False and payload["min_p"] == 0.0
    assert completion_payload([1, 5, 9], greedy, 7, cache_prompt=True)["cache_prompt"] is True
    assert not any(key.startswith("speculative.") for key in payload)  # the server's command line says
    sampled = GenerationConfig(16, 4, SamplingConfig(temperature=0.7, top_k=5, top_p=0.9))
    payload = completion_payload([1], sampled, 7)
    assert (payload["temperature"], payload["top_k"], payload["top_p"]) == (0.7, 5, 0.9)


def test_draft_settings_take_gamma_and_llama_cpps_defaults_unless_given():
    s = parse_speculation("llama.cpp-draft", "/x/d.gguf", 4)
    assert (s.spec_type, str(s.draft), s.options) == ("draft-simple", "/x/d.gguf", {"n_max": 4, "n_min": 0,
                                                                                    "p_min": 0.0})
    s = parse_speculation("llama.cpp-eagle3", "/x/e.gguf;n_max=2;p_min=0.75;n_min=1", 4)
    assert s.spec_type == "draft-eagle3" and s.options == {"n_max": 2, "n_min": 1, "p_min": 0.75}
    assert s.num_draft_tokens == 2
    assert s.args(2) == ["--spec-type", "draft-eagle3", "-md", "/x/e.gguf", "-td", "2", "-tbd", "2",
                         "--spec-draft-n-max", "2", "--spec-draft-n-min", "1", "--spec-draft-p-min", "0.75"]
    assert s.record() == {"type": "draft-eagle3", "draft": "/x/e.gguf", "n_max": 2, "n_min": 1, "p_min": 0.75}


def test_ngram_modes_pass_every_option_with_llama_cpps_defaults():
    s = parse_speculation("llama.cpp-ngram", "ngram-map-k;size_n=3;size_m=4")
    assert s.draft is None and s.options == {"size_n": 3, "size_m": 4, "min_hits": 1} and s.num_draft_tokens == 4
    assert s.args(2) == ["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3",
                         "--spec-ngram-map-k-size-m", "4", "--spec-ngram-map-k-min-hits", "1"]
    s = parse_speculation("llama.cpp-ngram", "ngram-mod")
    assert s.options == {"n_match": 24, "n_max": 64, "n_min": 48} and s.num_draft_tokens == 64


@pytest.mark.parametrize(("spec", "message"), [
    ("llama.cpp-ngram", "needs a mode"), ("llama.cpp-ngram:ngram-nope", "needs a mode"),
    ("llama.cpp-ngram:ngram-mod;size_n=3", "unknown option 'size_n'"),
    ("llama.cpp-draft:d.gguf;p_min=1.5", "out of range"), ("llama.cpp-draft:d.gguf;n_max=two", "needs an integer"),
    ("llama.cpp-draft:d.gguf;n_max=2;n_min=3", "n_min \\(3\\) is above n_max"),
    ("llama.cpp-eagle3:d.gguf;n_max=0", "at least 1"), ("llama.cpp-eagle3", "needs a draft model"),
])
def test_bad_llama_cpp_settings_are_refused_before_anything_runs(spec, message):
    with pytest.raises(SpecdraftError, match=message):
        parse_methods(f"ar,{spec}")


def test_the_answer_becomes_a_turn_with_llama_cpps_counters():
    answer = {"tokens": [5, 6, 7, 8, 2], "stop_type": "eos",
              "timings": {"prompt_ms": 12.0, "draft_n": 8, "draft_n_accepted": 3}}
    turn = turn_result(answer, 0.5, (2,), True, TurnResult)
    assert turn.token_ids == [5, 6, 7, 8, 2] and turn.finish_reason == "eos" and turn.prefill_seconds == 0.012
    assert (turn.draft_tokens_proposed, turn.draft_tokens_accepted, turn.decoding_steps) == (8, 3, 2)
    plain = turn_result({"tokens": [5, 6], "stop_type": "eos", "timings": {}}, 0.1, (2,), False, TurnResult)
    assert plain.token_ids == [5, 6, 2] and plain.draft_tokens_proposed is None and plain.decoding_steps == 3


def test_method_specs_parse():
    assert parse_methods("llama.cpp,llama.cpp-draft:/x/d.gguf") == ["ar", "llama.cpp", "llama.cpp-draft:/x/d.gguf"]
    assert parse_methods("llama.cpp-eagle3:/x/e.gguf;n_max=3,llama.cpp-ngram:ngram-mod;n_match=16")[1:] == [
        "llama.cpp-eagle3:/x/e.gguf;n_max=3", "llama.cpp-ngram:ngram-mod;n_match=16"]
    with pytest.raises(SpecdraftError, match="needs a draft model"):
        parse_methods("llama.cpp-draft")
    with pytest.raises(SpecdraftError, match="takes no argument"):
        parse_methods("llama.cpp:/x")


def test_a_server_that_fails_to_start_reports_its_log(fake_bin, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_text("--fail")
    with pytest.raises(SpecdraftError, match="failed to load model"):
        LlamaServer(bad)


def test_the_server_runs_and_stops(fake_bin, tmp_path):
    server = LlamaServer(_gguf(tmp_path / "t.gguf"), threads=1)
    answer = server.complete({"prompt": [1, 4], "n_predict": 3, "cache_prompt": False, "return_tokens": True})
    assert answer["tokens"] == [8, 9, 10] and "--spec-type" not in answer["args"]
    assert server.build["speculative"] is None and server.build["threads"] == 1
    process = server.process
    server.close()
    assert process.poll() is not None


def _build_info(cpu: str) -> dict:
    return {"format": FORMAT, "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "commit": "0c1e57098",
            "cmake_options": ["-DGGML_NATIVE=ON"], "machine": {"cpu": cpu, "flags": machine()["flags"]},
            "amx": {"enabled": False, "probe": "SIGILL: ...", "c_flags": ["-mno-amx-tile"]}}


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_bench_writes_llama_cpp_rows_beside_specdrafts(fake_bin, tmp_path, monkeypatch, prefix_cache):
    monkeypatch.setenv("FAKE_CACHE_PROMPT", "1" if prefix_cache else "0")  # the fake server checks each request
    write_build_info(fake_bin, _build_info(machine()["cpu"]))
    target = save_tiny_checkpoint(tmp_path / "target", seed=0)
    _gguf(target / "model.gguf")
    draft = _gguf(tmp_path / "draft.gguf")
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["w1 w2 w3", "w4 w5"]}) + "\n"
                         + json.dumps({"question_id": 2, "category": "rag", "turns": ["w7 w8"]}) + "\n")
    out = tmp_path / "run"
    code = main(["bench", "--target", str(target), "--questions", str(questions), "--out", str(out), "--methods",
                 f"ar,llama.cpp,llama.cpp-draft:{draft}", "--dtype", "float32", "--max-new-tokens", "6",
                 "--num-draft-tokens", "2", *([] if prefix_cache else ["--no-prefix-cache"])])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["setup"]["prefix_cache"] is prefix_cache
    assert ("--no-prefix-cache" in summary["setup"]["command"]) is not prefix_cache
    methods = summary["methods"]
    assert list(methods) == ["ar", "llama.cpp", f"llama.cpp-draft:{draft}"]
    drafted = methods[f"llama.cpp-draft:{draft}"]["overall"]
    assert drafted["acceptance_rate"] == pytest.approx(3 / 4) and drafted["num_draft_tokens"] == 2
    assert methods["llama.cpp"]["overall"]["greedy_equal"] is False  # reported, not assumed
    engine = methods["llama.cpp"]["engine"]  # which build answered, in the summary and in every record
    assert engine["checked"] and engine["commit"] == "0c1e57098" and engine["amx"] is False and engine["repack"]
    assert "engine" not in methods["ar"]
    records = [json.loads(line) for line in (out / "answers" / "llama.cpp.jsonl").read_text().splitlines()]
    assert records and all(r["engine"] == engine for r in records)
    assert "AMX off (SIGILL: ...), weight repacking on" in (out / "summary.md").read_text()


def test_each_llama_cpp_setting_is_one_server_with_its_options_on_the_command_line(fake_bin, tmp_path):
    write_build_info(fake_bin, _build_info(machine()["cpu"]))
    target = save_tiny_checkpoint(tmp_path / "target", seed=0)
    _gguf(target / "model.gguf")
    draft = _gguf(tmp_path / "draft.gguf")
    fixed, ngram = f"llama.cpp-draft:{draft};n_max=3;p_min=0.5", "llama.cpp-ngram:ngram-map-k;size_n=2;size_m=5"
    out = tmp_path / "run"
    code = main(["bench", "--target", str(target), "--questions", "builtin", "--per-category", "1", "--out",
                 str(out), "--methods", f"llama.cpp-draft:{draft},{fixed},{ngram}", "--dtype", "float32",
                 "--max-new-tokens", "4", "--sweep", "num_draft_tokens=1,2"])
    assert code == 0
    methods = json.loads((out / "summary.json").read_text())["methods"]
    swept = [f"llama.cpp-draft:{draft}@γ={k}" for k in (1, 2)]
    assert set(methods) == {"ar", *swept, fixed, ngram}
    for name, n_max in ((swept[0], 1), (swept[1], 2), (fixed, 3)):
        engine = methods[name]["engine"]["speculative"]
        assert engine == {"type": "draft-simple", "draft": str(draft), "n_max": n_max, "n_min": 0,
                          "p_min": 0.5 if name == fixed else 0.0}
        assert methods[name]["overall"]["num_draft_tokens"] == n_max
        # the stand-in drafts 2 x --spec-draft-n-max tokens per answer: the server got this setting's n_max
        assert methods[name]["overall"]["acceptance_rate"] == pytest.approx(3 / (2 * n_max))
    assert methods[ngram]["engine"]["speculative"] == {"type": "ngram-map-k", "draft": None, "size_n": 2,
                                                       "size_m": 5, "min_hits": 1}
    assert methods[ngram]["overall"]["num_draft_tokens"] == 5


def test_an_eagle3_method_refuses_a_draft_model_gguf(fake_bin, tmp_path, capsys):
    write_build_info(fake_bin, _build_info(machine()["cpu"]))
    target = save_tiny_checkpoint(tmp_path / "target", seed=0)
    _gguf(target / "model.gguf")
    draft = _gguf(tmp_path / "draft.gguf")
    code = main(["bench", "--target", str(target), "--questions", "builtin", "--per-category", "1", "--out",
                 str(tmp_path / "r"), "--methods", f"llama.cpp-eagle3:{draft}", "--dtype", "float32",
                 "--max-new-tokens", "4"])
    assert code == 2 and "needs an eagle3 GGUF" in capsys.readouterr().err


def test_bench_refuses_a_build_made_for_another_cpu(fake_bin, tmp_path, capsys):
    write_build_info(fake_bin, _build_info("Some Other CPU"))
    target = save_tiny_checkpoint(tmp_path / "target", seed=0)
    _gguf(target / "model.gguf")
    code = main(["bench", "--target", str(target), "--questions", "builtin", "--out", str(tmp_path / "r"),
                 "--methods", "llama.cpp", "--max-new-tokens", "4", "--dtype", "float32"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Some Other CPU" in err[-1] and err[-1].endswith("rerun `make engines`")


def test_a_draft_gguf_with_another_tokenizer_is_refused(fake_bin, tmp_path):
    target = save_tiny_checkpoint(tmp_path / "target", seed=0)
    _gguf(target / "model.gguf")
    tokens = tiny_tokenizer().convert_ids_to_tokens(list(range(64)))
    other = _gguf(tmp_path / "other.gguf", [*tokens[:5], "zz", *tokens[6:]])
    code = main(["bench", "--target", str(target), "--questions", "builtin", "--out", str(tmp_path / "r"),
                 "--methods", f"llama.cpp-draft:{other}", "--max-new-tokens", "4"])
    assert code == 2


def _dflash_gguf(path, mask: int | None = 63, arch: str = "dflash"):
    """A GGUF of llama.cpp's ``dflash`` architecture holding only the target's tokenizer plus the mask id."""
    import gguf

    tokens = tiny_tokenizer().convert_ids_to_tokens(list(range(64)))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{{ messages }}")
    if mask is not None:
        writer.add_mask_token_id(mask)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_dflash_setting_runs_its_gguf_with_draft_dflash(fake_bin, tmp_path):
    write_build_info(fake_bin, _build_info(machine()["cpu"]))
    target = save_tiny_checkpoint(tmp_path / "target", seed=0)
    _gguf(target / "model.gguf")
    dflash = _dflash_gguf(tmp_path / "dflash.gguf")
    spec = f"llama.cpp-dflash:{dflash};n_max=3;p_min=0.2"
    code = main(["bench", "--target", str(target), "--questions", "builtin", "--per-category", "1", "--out",
                 str(tmp_path / "run"), "--methods", f"llama.cpp,{spec}", "--dtype", "float32",
                 "--max-new-tokens", "4"])
    assert code == 0
    method = json.loads((tmp_path / "run" / "summary.json").read_text())["methods"][spec]
    assert method["engine"]["speculative"] == {"type": "draft-dflash", "draft": str(dflash), "n_max": 3, "n_min": 0,
                                               "p_min": 0.2}
    assert method["overall"]["acceptance_rate"] == pytest.approx(3 / 6)  # the stand-in's counters, n_max 3


@pytest.mark.parametrize(("method", "file", "message"), [
    ("llama.cpp-dflash", "draft", "needs a dflash GGUF"),
    ("llama.cpp-draft", "dflash", "needs a draft model GGUF"),
    ("llama.cpp-eagle3", "dflash", "needs an eagle3 GGUF"),
    ("llama.cpp-dflash", "nomask", "has no tokenizer.ggml.mask_token_id"),
])
def test_a_gguf_of_another_kind_is_refused(fake_bin, tmp_path, capsys, method, file, message):
    write_build_info(fake_bin, _build_info(machine()["cpu"]))
    target = save_tiny_checkpoint(tmp_path / "target", seed=0)
    _gguf(target / "model.gguf")
    path = tmp_path / f"{file}.gguf"
    _gguf(path) if file == "draft" else _dflash_gguf(path, None if file == "nomask" else 63)
    code = main(["bench", "--target", str(target), "--questions", "builtin", "--per-category", "1", "--out",
                 str(tmp_path / "r"), "--methods", f"{method}:{path}", "--dtype", "float32", "--max-new-tokens", "4"])
    assert code == 2 and message in capsys.readouterr().err
