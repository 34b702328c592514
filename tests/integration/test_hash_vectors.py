"""The hash scheme's test vectors (docs/reference/hash-vectors.json), checked against this
library and three independent RFC 8785 implementations: the `rfc8785` and `jcs` Python
packages, and the JavaScript `canonicalize` package under Node.js, which computes each
digest from the payload's JSON text as sent. Node.js and the package (``npm ci`` in
tests/vectors, done by ``scripts/bootstrap dev``) must be there: the test fails, never
skips, without them."""

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import jcs
import pytest
import rfc8785
from click.testing import CliRunner

from inbox_middleware._core.canonical import canonical_json, loads
from inbox_middleware._core.identity import PayloadHash
from inbox_middleware.cli import main
from inbox_middleware.faststream._payload import JSON_SCHEME, builtin_hash

ROOT = Path(__file__).resolve().parents[2]
VECTORS_FILE = ROOT / "docs" / "reference" / "hash-vectors.json"
NODE_CHECK = ROOT / "tests" / "vectors" / "check.mjs"
VECTORS = json.loads(VECTORS_FILE.read_text(encoding="utf-8"))["vectors"]
IDS = [vector["name"] for vector in VECTORS]


def test_vectors__there_are_enough_and_every_one_is_in_the_cross_language_domain():
    assert len(VECTORS) >= 40
    for vector in VECTORS:
        # no integer beyond +-(2**53 - 1): RFC 8785 implementations read them as doubles
        assert canonical_json(loads(vector["json"])) == rfc8785.dumps(json.loads(vector["json"]))


@pytest.mark.parametrize("vector", VECTORS, ids=IDS)
def test_vectors__the_library_gives_the_canonical_form_and_the_digest(vector):
    canonical = canonical_json(loads(vector["json"]))
    assert canonical.decode("utf-8") == vector["canonical"]
    assert hashlib.sha256(canonical).hexdigest() == vector["sha256"]
    # the digest a FastStream consumer stores for the body as sent
    body = vector["json"].encode("utf-8")
    assert builtin_hash(body) == PayloadHash(JSON_SCHEME, vector["sha256"])


@pytest.mark.parametrize("vector", VECTORS, ids=IDS)
def test_vectors__the_rfc8785_and_jcs_packages_agree(vector):
    value = json.loads(vector["json"])
    assert rfc8785.dumps(value).decode("utf-8") == vector["canonical"]
    assert jcs.canonicalize(value).decode("utf-8") == vector["canonical"]


def test_vectors__the_hash_command_prints_them():
    for vector in VECTORS[:5]:
        result = CliRunner().invoke(main, ["hash"], input=vector["json"].encode("utf-8"))
        assert result.exit_code == 0, result.output
        assert result.output.splitlines() == [vector["canonical"], vector["sha256"]]


def test_vectors__javascript_canonicalize_under_node_agrees_from_the_json_text_as_sent():
    node = shutil.which("node")
    assert node is not None, "Node.js is needed for this test (scripts/bootstrap dev installs it)"
    package = ROOT / "tests" / "vectors" / "node_modules" / "canonicalize"
    assert package.is_dir(), "run `npm ci --prefix tests/vectors` (scripts/bootstrap dev does)"
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=True)
    assert int(version.stdout.strip().lstrip("v").split(".")[0]) >= 20, version.stdout
    result = subprocess.run(
        [node, str(NODE_CHECK), str(VECTORS_FILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith(f"{len(VECTORS)} vectors agree, 0 differ")
