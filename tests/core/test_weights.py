"""Weights decisions (llmgw/core/_weights.py): sources, manifests, reclaim safety."""

from __future__ import annotations

import hashlib
import json
import ntpath
import os
import posixpath
import tempfile

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from llmgw.core import (
    Manifest,
    ManifestError,
    ManifestFile,
    SourceKind,
    Tree,
    TreeDir,
    TreeFile,
    TreeLink,
    cache_name,
    check_manifest,
    classify_source,
    is_cache_name,
    may_delete,
    plan_reclaim,
    wanted_cache_names,
)
from llmgw.errors import ConfigError

# --- sources -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "kind"),
    [
        ("/models/qwen.gguf", SourceKind.LOCAL),
        ("./models/qwen.gguf", SourceKind.LOCAL),
        ("../models/", SourceKind.LOCAL),
        ("https://files.example/qwen/qwen-7b.gguf", SourceKind.URL_FILE),
        ("HTTP://files.example/qwen/model.gguf?sig=abc/", SourceKind.URL_FILE),
        ("https://files.example/qwen/", SourceKind.URL_VERSION),
        ("http://10.0.0.1:8000/v2/?token=x", SourceKind.URL_VERSION),
        ("mirror:/tiny.gguf", SourceKind.MIRROR_FILE),
        ("mirror:/qwen/7b/model.gguf", SourceKind.MIRROR_FILE),
        ("mirror:/tiny/", SourceKind.MIRROR_VERSION),
        ("Qwen/Qwen2.5-7B-Instruct", SourceKind.HUB),
        ("gpt2", SourceKind.HUB),
        ("s3://bucket/key", SourceKind.HUB),  # not ours to read: the engine's business
    ],
)
def test_a_source_is_classified_by_its_text(source: str, kind: SourceKind) -> None:
    got = classify_source(source)
    assert got.kind is kind
    assert got.text == source
    assert got.fetched == (kind not in (SourceKind.LOCAL, SourceKind.HUB))
    assert got.version == (kind in (SourceKind.URL_VERSION, SourceKind.MIRROR_VERSION))
    assert got.cache_name == (cache_name(source) if got.fetched else None)


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ("", "empty or surrounded by spaces"),
        (" mirror:/tiny/", "empty or surrounded by spaces"),
        ("mirror:/ti\nny/", "holds a control character"),
        ("mirror:tiny/", "a mirror source is mirror:/path"),
        ("mirror:/", "a mirror source is mirror:/path"),
        ("mirror:/a/../b/", "path part '..' is not allowed"),
        ("mirror:/a//b", "path part '' is not allowed"),
        ("mirror:/./b", "path part '.' is not allowed"),
        ("mirror:/a\\b", "path part 'a\\\\b' is not allowed"),
        ("https://", "a URL needs a host and a path"),
        ("https://files.example", "a URL needs a host and a path"),
    ],
)
def test_a_source_that_cannot_be_right_is_refused_by_name(source: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        classify_source(source)
    assert str(info.value).startswith(f"source {source!r}: ")
    assert problem in str(info.value)
    assert "\n" not in str(info.value)


def test_cache_names_are_stable_and_checked() -> None:
    name = cache_name("mirror:/tiny/")
    # Pinned: a node keeps what it fetched across upgrades only while this holds.
    assert name == "src-9fdfd476d16ea957a513217e84090250"
    assert name == "src-" + hashlib.sha256(b"mirror:/tiny/").hexdigest()[:32]
    assert is_cache_name(name)
    assert cache_name("mirror:/tiny") != name
    for bad in [
        name.upper(),
        name[:-1],
        name + "0",
        name + ".partial",
        name[4:],
        "models",
        "src-" + "g" * 32,
        "",
    ]:
        assert not is_cache_name(bad), bad


@given(st.text(max_size=60), st.text(max_size=60))
def test_cache_names_differ_for_different_sources(a: str, b: str) -> None:
    assert is_cache_name(cache_name(a))
    assert (cache_name(a) == cache_name(b)) == (a == b)


@given(st.text(max_size=80))
def test_classify_keeps_the_text_or_raises_config_error(text: str) -> None:
    try:
        got = classify_source(text)
    except ConfigError as exc:
        assert str(exc).startswith(f"source {text!r}: ")
    else:
        assert got.text == text


_segment = st.text(st.characters(codec="utf-8", exclude_characters="/\\"), min_size=1).filter(
    lambda s: s not in (".", "..") and not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in s)
)


@given(st.lists(_segment, min_size=1, max_size=4), st.booleans())
def test_a_mirror_source_is_a_version_exactly_when_it_ends_in_a_slash(
    parts: list[str], slash: bool
) -> None:
    text = "mirror:/" + "/".join(parts) + ("/" if slash else "")
    if text != text.strip():
        return
    got = classify_source(text)
    assert got.kind is (SourceKind.MIRROR_VERSION if slash else SourceKind.MIRROR_FILE)


def test_the_catalog_wants_its_fetched_sources_and_what_local_sources_point_into() -> None:
    w = "/var/lib/llmgw-weights"
    held = cache_name("mirror:/old/")
    wanted = wanted_cache_names(
        [
            "mirror:/tiny/",
            "https://files.example/a.gguf",
            "Qwen/Qwen2.5-7B-Instruct",
            f"{w}/{held}/model.gguf",
            f"/var/lib/other/../llmgw-weights/{cache_name('x')}/model.gguf",
            "/models/operator.gguf",
            "mirror:broken",
        ],
        weights_dir=w + "/",
    )
    assert wanted == {
        cache_name("mirror:/tiny/"),
        cache_name("https://files.example/a.gguf"),
        held,
        cache_name("x"),
    }


def test_any_text_has_a_cache_name() -> None:
    assert is_cache_name(cache_name("mirror:/a\ud800/"))


# --- manifests -----------------------------------------------------------------------------

LIMITS = {"max_bytes": 4096, "max_files": 8}
SHA = "ab" * 32


def manifest(*files: object, **extra: object) -> bytes:
    return json.dumps({"files": list(files), **extra}).encode()


def test_a_manifest_is_read_with_its_sizes_and_hashes() -> None:
    data = manifest(
        {"name": "tiny-00001-of-00002.gguf", "size": 1000, "sha256": SHA.upper(), "mtime": 1},
        {"name": "tiny-00002-of-00002.gguf", "size": 0, "sha256": None},
        {"name": "README ünïcode.md", "size": 12},
        version=2,
    )
    got = check_manifest(data, **LIMITS)
    assert got == Manifest(
        (
            ManifestFile("tiny-00001-of-00002.gguf", 1000, SHA),
            ManifestFile("tiny-00002-of-00002.gguf", 0, None),
            ManifestFile("README ünïcode.md", 12, None),
        )
    )
    assert isinstance(got, Manifest)
    assert got.total_bytes == 1012


def f(name: object, size: object = 1, **more: object) -> dict[str, object]:
    return {"name": name, "size": size, **more}


HOSTILE: list[tuple[str, bytes, str]] = [
    ("dot-dot", manifest(f("..")), "file 0: name '..' is not a file name"),
    ("dot", manifest(f(".")), "file 0: name '.' is not a file name"),
    ("empty", manifest(f("")), "file 0: name '' an empty name"),
    ("not a string", manifest(f(7)), "file 0: name 7 a name must be a string, got int"),
    ("no name", manifest({"size": 1}), "file 0: name None a name must be a string"),
    ("separator", manifest(f("a/b")), "name 'a/b' holds a path separator"),
    ("escape", manifest(f("ok"), f("../../etc/cron.d/x")), "file 1: name '../../etc/cron.d/x'"),
    ("backslash", manifest(f("a\\b")), "holds a path separator"),
    ("absolute", manifest(f("/etc/passwd")), "name '/etc/passwd' is an absolute path"),
    ("windows absolute", manifest(f("\\x")), "is an absolute path"),
    ("nul", manifest(f("a\x00b")), "name 'a\\x00b' holds a NUL byte"),
    ("escape char", manifest(f("a\x1b[2Jb")), "holds a control character"),
    ("c1 control", manifest(f("a\x85b")), "holds a control character"),
    ("surrogate", b'{"files": [{"name": "a\\ud800", "size": 1}]}', "is not valid Unicode"),
    ("long", manifest(f("é" * 128)), "is 256 bytes long, at most 255"),
    ("partial", manifest(f("model.gguf.partial")), "names the fetcher keeps for itself"),
    ("marker", manifest(f(".llmgw-complete")), "names the fetcher keeps for itself"),
    ("twice", manifest(f("a"), f("b"), f("a")), "file 2: name 'a' is listed twice"),
    ("negative", manifest(f("a", -1)), "file 0 ('a'): size -1 is not a whole number"),
    ("float", manifest(f("a", 1.5)), "size 1.5 is not a whole number"),
    ("bool", manifest(f("a", True)), "size True is not a whole number"),
    ("text size", manifest(f("a", "1")), "size '1' is not a whole number"),
    ("no size", manifest({"name": "a"}), "size None is not a whole number"),
    ("short sha", manifest(f("a", sha256="ab" * 31)), "sha256 '" + "ab" * 31 + "' is not 64"),
    ("non-hex sha", manifest(f("a", sha256="zz" * 32)), "is not 64 hex digits"),
    ("sha not text", manifest(f("a", sha256=12)), "sha256 12 is not 64 hex digits"),
    ("entry not object", manifest("a.gguf"), 'file 0: not {"name", "size"}, got \'a.gguf\''),
    ("too many", manifest(*[f(str(i)) for i in range(9)]), "lists 9 files, at most 8"),
    ("none", manifest(), "the manifest lists no files"),
    ("files not a list", b'{"files": {"a": 1}}', 'the manifest is not {"files": [...]}'),
    ("a list", b"[]", 'the manifest is not {"files": [...]}, got []'),
    ("big", manifest(f("a" * 200), big="x" * 5000), "the manifest is over 4096 bytes"),
    ("html", b"<!DOCTYPE html><html><body><a href='a.gguf'>", "got an HTML page where"),
    ("html spaced", b"\xef\xbb\xbf\r\n  <HTML>\n<title>Index of /</title>", "got an HTML page"),
    ("big html", b"<html>" + b"x" * 10_000, "not an llmgw mirror"),
    ("not json", b"files: [a.gguf]", "the manifest is not JSON (Expecting value"),
    ("not utf-8", b'{"files": [{"name": "\xff", "size": 1}]}', "is not UTF-8 (byte 21)"),
    ("deep", b"[" * 2000 + b"]" * 2000, "it nests too deep"),
    ("huge int", b'{"files":[{"name":"a","size":' + b"9" * 4400 + b"}]}", "a number too long"),
    ("empty body", b"", "the manifest is not JSON"),
]


@pytest.mark.parametrize(("data", "problem"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_a_hostile_manifest_is_refused_in_one_line(data: bytes, problem: str) -> None:
    got = check_manifest(data, max_bytes=8192 if b"big" not in data else 4096, max_files=8)
    assert isinstance(got, ManifestError)
    assert problem in got.message
    assert "\n" not in got.message
    assert len(got.message) < 300


def test_an_html_page_is_named_as_such() -> None:
    got = check_manifest(b"<html><body>Index of /tiny/</body></html>", **LIMITS)
    assert got == ManifestError(
        "got an HTML page where a manifest was expected — that server is not an llmgw mirror"
    )


def test_a_255_byte_name_is_a_file_name() -> None:
    got = check_manifest(manifest(f("é" * 127 + "x")), **LIMITS)
    assert isinstance(got, Manifest)
    assert len(got.files[0].name.encode()) == 255


@given(st.binary(max_size=300))
def test_any_bytes_are_read_or_refused_never_raised(data: bytes) -> None:
    got = check_manifest(data, **LIMITS)
    assert isinstance(got, Manifest | ManifestError)


def test_a_manifest_cut_short_anywhere_is_refused() -> None:
    data = manifest(f("a.gguf", 10, sha256=SHA), f("b.gguf", 20))
    assert isinstance(check_manifest(data, **LIMITS), Manifest)
    for n in range(len(data)):
        got = check_manifest(data[:n], **LIMITS)
        assert isinstance(got, ManifestError), data[:n]


# Names a hostile mirror would try: separators, dots, controls, long and odd Unicode.
_name = st.one_of(
    st.text(max_size=12),
    st.text(alphabet="./\\\x00\x1f\x7f\x85a", max_size=8),
    st.sampled_from(["..", ".", "", "/", "a/..", "..\\a", "C:\\x", "x.partial", ".llmgw-x"]),
    st.text(alphabet="éa", min_size=120, max_size=140),
    st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2),
)


def _oracle_ok(name: str) -> bool:
    """A file name a directory can hold as one entry, written independently of the module."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return False
    return (
        name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in name)
        and size <= 255
        and not name.endswith(".partial")
        and not name.startswith(".llmgw")
    )


@given(st.lists(_name, min_size=1, max_size=5))
def test_no_accepted_manifest_names_a_file_outside_its_directory(names: list[str]) -> None:
    data = json.dumps({"files": [f(n) for n in names]}).encode()
    got = check_manifest(data, max_bytes=1 << 20, max_files=8)
    # As the mirror sends them: JSON joins a surrogate pair into one character.
    sent = [json.loads(json.dumps(n)) for n in names]
    expected = all(_oracle_ok(n) for n in sent) and len(set(sent)) == len(sent)
    assert isinstance(got, Manifest) == expected, got
    if isinstance(got, Manifest):
        base = "/var/lib/llmgw-weights/src-" + "0" * 32
        for file in got.files:
            for path in (posixpath, ntpath):
                joined = path.normpath(path.join(base, file.name))
                assert path.dirname(joined) == path.normpath(base)
                assert joined != path.normpath(base)


# --- reclaim -------------------------------------------------------------------------------

W = "/var/lib/llmgw-weights"
A, B, C, D, E, G, H = (cache_name(f"mirror:/{x}/") for x in "abcdegh")


def example_tree() -> Tree:
    return Tree(
        {
            A: TreeDir(),
            f"{A}/model.gguf": TreeFile(100),
            f"{A}/.llmgw-complete": TreeFile(0),
            B: TreeDir(),
            f"{B}/model.gguf": TreeFile(200),
            C: TreeDir(),
            f"{C}/x.gguf": TreeFile(300),
            D: TreeLink("/data/elsewhere"),
            E: TreeDir(),
            f"{E}/link": TreeLink("/etc"),
            G: TreeFile(400),  # a single fetched file, not a directory: still one entry
            H: TreeDir(),
            f"{H}/sub": TreeDir(),
            f"{H}/sub/part.gguf.partial": TreeFile(50),
            "models": TreeDir(),
            "models/mine.gguf": TreeFile(1000),
            "notes.txt": TreeFile(5),
            "current": TreeLink(C),  # an operator's name for a cache entry
            "src-" + "0" * 31: TreeFile(7),  # one hex digit short: an operator's file
        }
    )


@pytest.mark.parametrize(
    ("path", "reason", "detail"),
    [
        (f"{W}/{A}", None, None),
        (f"{W}/{A}/model.gguf", None, None),
        (f"{W}//{A}/./model.gguf", None, None),
        (f"{W}/{G}", None, None),
        (f"{W}/{H}/sub/part.gguf.partial", None, None),
        (f"{A}", "not an absolute path", "reclaim takes absolute paths"),
        (f"{W}/{B}", "still wanted by the catalog", None),
        (f"{W}/{B}/model.gguf", "still wanted by the catalog", None),
        (f"{W}/{C}", "a symlink leads to it", f"(current -> '{C}')"),
        (f"{W}/{C}/x.gguf", "a symlink leads to it", None),
        (f"{W}/{D}", "a symlink", "(to '/data/elsewhere'); links are never reclaimed"),
        (f"{W}/{E}", "holds a symlink", f"({E}/link -> '/etc')"),
        (f"{W}/{E}/link", "a symlink", None),
        (f"{W}/{E}/link/passwd", "reached through a symlink", f"({E}/link -> '/etc')"),
        (f"{W}/{A}/../models", "traverses out with '..'", None),
        (f"{W}/{A}/..", "traverses out with '..'", None),
        (f"{W}/models", "not a cache name", "'models' is not src-<32 hex digits>"),
        (f"{W}/models/mine.gguf", "not a cache name", "files an operator put there"),
        (f"{W}/notes.txt", "not a cache name", None),
        (f"{W}/current", "not a cache name", None),
        (f"{W}/src-{'0' * 31}", "not a cache name", None),
        (W, "the weights directory itself", None),
        (W + "/", "the weights directory itself", None),
        ("/", "outside the weights directory", None),
        (f"/var/lib/{A}", "outside the weights directory", "outside the weights directory /var"),
        (f"{W}-other/{A}", "outside the weights directory", None),
        (f"{W}/{cache_name('mirror:/gone/')}", "not on disk", None),
        (f"{W}/{A}/missing.gguf", "not on disk", None),
        (f"{W}/{G}/inside", "not on disk", f"({G} is a file)"),
    ],
)
def test_may_delete_names_each_refusal(path: str, reason: str | None, detail: str | None) -> None:
    got = may_delete(path, weights_dir=W, wanted=frozenset({B}), tree=example_tree())
    assert got.allowed == (reason is None)
    assert bool(got) == got.allowed
    assert got.reason == reason
    if reason is not None:
        assert got.detail is not None and got.detail.startswith(f"{path}: {reason}")
        assert "\n" not in got.detail
    if detail is not None:
        assert detail in (got.detail or "")


def test_plan_reclaim_takes_whole_entries_and_never_an_operators() -> None:
    plan = plan_reclaim(W, example_tree(), frozenset({B}))
    assert plan == sorted(
        [(f"{W}/{A}", 100), (f"{W}/{G}", 400), (f"{W}/{H}", 50)], key=lambda r: r[0]
    )
    assert plan[0].path == plan[0][0] and plan[0].size_bytes == plan[0][1]


def test_links_are_followed_through_chains_and_back_in_from_outside() -> None:
    tree = Tree(
        {
            A: TreeDir(),
            B: TreeDir(),
            C: TreeDir(),
            D: TreeDir(),
            E: TreeDir(),
            "l1": TreeLink("l2"),  # a chain ends at A
            "l2": TreeLink(f"./{A}/"),
            "l3": TreeLink(f"../llmgw-weights/{B}"),  # out and back in
            "l4": TreeLink(f"/var//lib/../lib/llmgw-weights/{C}/deep/file"),  # under C
            "loop1": TreeLink("loop2"),
            "loop2": TreeLink("loop1"),
            "out": TreeLink("../../other"),  # /var/other: nothing inside is held by it
            f"{D}-x": TreeLink(D),
        }
    )
    reasons = {
        name: may_delete(f"{W}/{name}", weights_dir=W, wanted=frozenset(), tree=tree).reason
        for name in (A, B, C, D, E)
    }
    assert reasons == {
        A: "a symlink leads to it",
        B: "a symlink leads to it",
        C: "a symlink leads to it",
        D: "a symlink leads to it",
        E: None,
    }
    assert plan_reclaim(W, tree, frozenset()) == [(f"{W}/{E}", 0)]


@pytest.mark.parametrize("target", [".", "..", "/", "/var/lib", f"{A}/.."])
def test_a_link_to_the_weights_directory_or_above_holds_all_of_it(target: str) -> None:
    tree = Tree({A: TreeDir(), "all": TreeLink(target)})
    assert may_delete(f"{W}/{A}", weights_dir=W, wanted=frozenset(), tree=tree).reason == (
        "a symlink leads to it"
    )
    assert plan_reclaim(W, tree, frozenset()) == []


@pytest.mark.parametrize(
    ("entries", "problem"),
    [
        ({"a/b": TreeFile(1)}, "tree entry 'a/b' has no directory 'a' in the tree"),
        ({"a": TreeFile(1), "a/b": TreeFile(1)}, "has no directory 'a'"),
        ({"/a": TreeFile(1)}, "is not a normalised relative path"),
        ({"a/../b": TreeFile(1)}, "is not a normalised relative path"),
        ({"./a": TreeFile(1)}, "is not a normalised relative path"),
    ],
)
def test_a_tree_that_does_not_describe_a_disk_is_refused(
    entries: dict[str, TreeFile], problem: str
) -> None:
    with pytest.raises(ValueError, match="tree entry") as info:
        Tree(entries)
    assert problem in str(info.value)


# --- reclaim properties, checked against the kernel ------------------------------------------
#
# Generated trees are written to a real temporary directory, which then is the weights
# directory, so the oracle is the kernel's own path resolution (os.path.realpath,
# os.path.islink), not a second copy of the module's logic.

CACHE = [cache_name(f"s{i}") for i in range(3)]
OPERATOR = ["models", "src-x"]
NAMES = CACHE + OPERATOR
TARGETS = st.one_of(
    st.sampled_from(NAMES),
    st.builds(lambda a, b: f"{a}/{b}", st.sampled_from(NAMES), st.sampled_from(NAMES)),
    st.builds(lambda a: f"../{a}", st.sampled_from(NAMES)),
    st.builds(lambda a: f"../../{a}", st.sampled_from(NAMES)),
    st.sampled_from([".", "..", "/", "/etc", "{W}", "{W}/..", "{W}-other"]),
    st.builds(lambda a: "{W}/" + a, st.sampled_from(NAMES)),
    st.builds(lambda a: "{W}/../" + "{WN}/" + a, st.sampled_from(NAMES)),
    st.builds(lambda a: "{W}/./" + a + "/", st.sampled_from(NAMES)),
)


@st.composite
def trees(draw: st.DrawFn) -> dict[str, tuple[str, object]]:
    """relative path -> ("file", size) | ("dir", None) | ("link", target template)."""
    out: dict[str, tuple[str, object]] = {}

    def level(prefix: str, depth: int) -> None:
        for name in draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=4)):
            key = f"{prefix}{name}"
            kind = draw(st.sampled_from(["file", "dir", "link"] if depth < 2 else ["file", "link"]))
            if kind == "file":
                out[key] = ("file", draw(st.integers(0, 5)))
            elif kind == "link":
                out[key] = ("link", draw(TARGETS))
            else:
                out[key] = ("dir", None)
                level(key + "/", depth + 1)

    level("", 0)
    return out


PATHS = st.one_of(
    st.builds(
        lambda parts: "{W}/" + "/".join(parts),
        st.lists(st.sampled_from([*NAMES, "..", ".", "", "missing"]), min_size=0, max_size=4),
    ),
    st.sampled_from(["/", "/etc", "{W}-other/" + CACHE[0], "{W}/../" + CACHE[0], CACHE[0]]),
)


def _materialise(root: str, spec: dict[str, tuple[str, object]]) -> Tree:
    entries: dict[str, TreeFile | TreeDir | TreeLink] = {}
    for key, (kind, value) in sorted(spec.items()):
        path = os.path.join(root, key)
        if kind == "dir":
            os.mkdir(path)
            entries[key] = TreeDir()
        elif kind == "file":
            assert isinstance(value, int)
            with open(path, "wb") as out:
                out.write(b"x" * value)
            entries[key] = TreeFile(value)
        else:
            target = _fill(str(value), root)
            os.symlink(target, path)
            entries[key] = TreeLink(target)
    return Tree(entries)


def _fill(template: str, root: str) -> str:
    return template.replace("{WN}", os.path.basename(root)).replace("{W}", root)


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _kernel_says_deletable(path: str, root: str, wanted: frozenset[str]) -> bool:
    """Deletable as the issue defines it, judged with the real filesystem."""
    if not path.startswith("/") or ".." in path.split("/"):
        return False
    norm = os.path.normpath(path)
    if not _within(norm, root) or norm == root:
        return False
    top = os.path.relpath(norm, root).split("/")[0]
    if not is_cache_name(top) or top in wanted:
        return False
    if not os.path.lexists(norm) or os.path.realpath(norm) != norm:
        return False  # missing, a link, or reached through one
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            link = os.path.join(dirpath, name)
            if not os.path.islink(link):
                continue
            if _within(link, norm):
                return False  # it holds a link
            target = os.path.realpath(link)
            if _within(target, norm) or _within(norm, target):
                return False  # a link leads to it, or into it
    return True


@settings(max_examples=300, deadline=None)
@given(trees(), st.data(), st.sets(st.sampled_from(CACHE), max_size=2))
def test_may_delete_agrees_with_the_kernel(
    spec: dict[str, tuple[str, object]], data: st.DataObject, wanted: set[str]
) -> None:
    # Mostly what is there (else nearly every path is simply missing), and odd spellings.
    there = st.sampled_from(sorted(spec)).map(lambda k: "{W}/" + k) if spec else PATHS
    below = st.builds(lambda p, n: f"{p}/{n}", there, st.sampled_from(NAMES))  # through links
    paths = data.draw(st.lists(st.one_of(there, there, below, PATHS), min_size=1, max_size=6))
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.realpath(os.path.join(tmp, "llmgw-weights"))
        os.mkdir(root)
        tree = _materialise(root, spec)
        frozen = frozenset(wanted)
        for template in paths:
            path = _fill(template, root)
            got = may_delete(path, weights_dir=root, wanted=frozen, tree=tree)
            event(got.reason or "allowed")
            assert got.allowed == _kernel_says_deletable(path, root, frozen), (path, got)
            if got.allowed:
                # The properties the issue names, each on its own:
                real = os.path.realpath(path)
                assert _within(real, root) and real != root
                assert not os.path.islink(path)
                assert real == os.path.normpath(path)
                assert is_cache_name(os.path.relpath(real, root).split("/")[0])
                assert os.path.relpath(real, root).split("/")[0] not in frozen

        plan = plan_reclaim(root, tree, frozen)
        tops = [k for k in spec if "/" not in k]
        assert [p for p, _ in plan] == sorted(
            f"{root}/{t}" for t in tops if _kernel_says_deletable(f"{root}/{t}", root, frozen)
        )
        for path, size in plan:
            assert may_delete(path, weights_dir=root, wanted=frozen, tree=tree)
            assert is_cache_name(os.path.basename(path))  # operator files never
            on_disk = sum(
                os.path.getsize(os.path.join(d, n))
                for d, _, names in os.walk(path)
                for n in names
                if not os.path.islink(os.path.join(d, n))
            )
            assert size == (os.path.getsize(path) if os.path.isfile(path) else on_disk)


@given(trees(), st.sets(st.sampled_from(CACHE)))
def test_without_links_every_unwanted_cache_entry_is_reclaimed(
    spec: dict[str, tuple[str, object]], wanted: set[str]
) -> None:
    spec = {k: v for k, v in spec.items() if v[0] != "link" and not k.startswith("src-x")}
    tree = Tree(
        {
            k: TreeDir() if kind == "dir" else TreeFile(v)  # type: ignore[arg-type]
            for k, (kind, v) in spec.items()
            if all(p in spec for p in _parents(k))
        }
    )
    plan = plan_reclaim(W, tree, frozenset(wanted))
    expected = {k for k in tree.entries if "/" not in k and k in CACHE and k not in wanted}
    assert {p.rsplit("/", 1)[1] for p, _ in plan} == expected


def _parents(key: str) -> list[str]:
    parts = key.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


@pytest.mark.parametrize("weights_dir", ["llmgw-weights", "", "/var/lib/../lib/llmgw-weights"])
def test_a_weights_directory_that_is_not_absolute_and_resolved_is_a_bug(weights_dir: str) -> None:
    with pytest.raises(ValueError, match="must be an absolute, resolved path"):
        may_delete(f"/{A}", weights_dir=weights_dir, wanted=frozenset(), tree=Tree({A: TreeDir()}))
    with pytest.raises(ValueError, match="must be an absolute, resolved path"):
        plan_reclaim(weights_dir, Tree({A: TreeDir()}), frozenset())
