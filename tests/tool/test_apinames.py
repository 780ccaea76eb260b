"""hybridpd.porting.apinames: the upstream API a patch calls that a port's target lacks."""

from __future__ import annotations

import subprocess
from pathlib import Path

from hybridpd.porting import apinames

PATCH = """\
diff --git a/vllm/sched.py b/vllm/sched.py
--- a/vllm/sched.py
+++ b/vllm/sched.py
@@ -1,4 +1,9 @@
 class Scheduler:
-    def admit(self, request):
-        return self.manager.lookup(request)
+    def admit(self, request, cap=None):
+        groups = self.connector.get_loaded_group_ids(request)
+        return self.manager.lookup(request) and self._restores(groups)
+
+    def _restores(self, groups):
+        return bool(groups)
"""


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def _release(repo: Path, tag: str, connector_defs: str) -> None:
    (repo / "vllm").mkdir(exist_ok=True)
    (repo / "vllm" / "sched.py").write_text(
        "class Scheduler:\n    def admit(self, request):\n"
        "        return self.manager.lookup(request)\n"
    )
    (repo / "vllm" / "manager.py").write_text("def lookup(request):\n    return 1\n")
    (repo / "vllm" / "connector.py").write_text(connector_defs)
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", tag)
    _git(repo, "tag", tag)


def test_names_the_patch_calls_and_defines() -> None:
    called, defined = apinames.used_names(PATCH)
    assert called == {"get_loaded_group_ids", "lookup", "_restores"}
    assert defined == {"admit", "_restores"}


def test_a_method_only_the_source_release_defines_is_missing_on_the_target(tmp_path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _release(repo, "v1", "class Base:\n    pass\n")  # the older target: no such method
    _release(repo, "v2", "class Base:\n    def get_loaded_group_ids(self, request):\n"
                         "        return ()\n")
    patch = tmp_path / "fix.patch"
    patch.write_text(PATCH)
    # lookup is upstream's on both; _restores is the patch's own; admit is rewritten by
    # the patch and exists on both.
    assert apinames.missing(repo, patch, "v2", "v1") == ("get_loaded_group_ids",)
    assert apinames.missing(repo, patch, "v2", "v2") == ()
