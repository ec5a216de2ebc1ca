"""Chat templates run sandboxed and bounded: a template that escapes, hangs or blows up
memory ends in one LoracError line, quickly and without growing the process."""
import resource
import time

import pytest

import lorac.runtime.model.chat_template as ct
from lorac.runtime.errors import LoracError

jinja2 = pytest.importorskip("jinja2")
MESSAGES = [{"role": "user", "content": "What is a kludge?"}, {"role": "assistant", "content": "A clever hack."}]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def render(source, **kw):
    return ct.render(ct.compile_template(source), 64, messages=MESSAGES, **kw)


def test_ordinary_templates_render_as_plain_jinja_does():
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(CHATML)
    for gen in (False, True):
        assert render(CHATML, add_generation_prompt=gen) == plain.render(messages=MESSAGES, add_generation_prompt=gen)
    tpl = "{{ messages|map(attribute='content')|join(' | ')|upper }} {{ '%-6s|' % 'ab' }} {{ '{:>4}'.format(7) }}"
    assert render(tpl) == "WHAT IS A KLUDGE? | A CLEVER HACK. ab    |    7"


BOMBS = {
    "{{ 'x' * 3000000000 }}": "repeats a value 3000000000 times",
    "{{ ([1] * 100000) * 100000 }}": "repeats a value",
    "{{ 10 ** 100000000 }}": "raises 10 to the power",
    "{{ 'x'.ljust(1000000000) }}": "passes 1000000000 to ljust",
    "{{ '{:>999999999}'.format(1) }}": "formats with a width",
    "{{ '%999999999s' % 'x' }}": "formats with a width",
    "{{ ('x' * 100000)|replace('x', 'y' * 100000) }}": "its replace would build",
    "{{ (['a'] * 100000)|join('y' * 100000) }}": "its join would build",
    "{{ ('a\\n' * 100000)|indent(100000) }}": "its indent would build",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}": "builds a value",
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}": "output passes",
    "{{ 'x'|center(1000000000) }}": "passes 1000000000 to center",  # folded at compile time
    "{{ ''.__class__.__mro__[1].__subclasses__() }}": "SecurityError",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}": "SecurityError",
    "{{ 1 + 'a' }}": "TypeError",
    "{{ foo.bar.baz }}": "UndefinedError",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}": "RecursionError",
    "{{ raise_exception('no system role') }}": "chat template: no system role",
}


@pytest.mark.parametrize("source", sorted(BOMBS))
def test_hostile_template_is_one_line(source):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with pytest.raises(LoracError, match=BOMBS[source]) as e:
        render(source)
    assert "\n" not in str(e.value) and time.perf_counter() - t0 < 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB: no GB allocations


def test_a_template_that_loops_forever_is_stopped_by_the_time_limit(monkeypatch):
    monkeypatch.setattr(ct, "TIME_LIMIT", 0.3)
    t0 = time.perf_counter()
    with pytest.raises(LoracError, match="ran past its time limit of 0.3 s"):
        render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    assert time.perf_counter() - t0 < 2


def test_data_loader_names_the_record_whose_template_failed(tmp_path):
    import json
    from tokenizers import Tokenizer as Backend, models
    from lorac.runtime.data import load_dataset
    from lorac.runtime.model.tokenizer import Tokenizer
    backend = Backend(models.WordLevel({"<unk>": 0, "<eos>": 1}, unk_token="<unk>"))
    tok = Tokenizer(backend, eos_id=1, chat_template="{{ messages[0]['content'] * 3000000000 }}", source="m")
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": MESSAGES}) + "\n")
    with pytest.raises(LoracError, match=r"chat\.jsonl:1: chat template stopped: it repeats a value"):
        load_dataset(path, tok, 8, 2)
