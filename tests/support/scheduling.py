"""The first part's scheduler (``--dist loadgroup``): a unit of work is a test module, or
all the modules that stop the same server of their own (`serial.group`), so that they run
one after the other in one process.

pytest-xdist's own ``loadgroup`` reads ``xdist_group`` marks by renaming each test's node
id, which pytest 9 no longer lets it do (the node id is computed): the tests of a group
were spread over both processes. This scheduler reads the group from the module's path
instead."""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

from .serial import group


class ServerGroupScheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
        return group(nodeid.split("::", 1)[0].split("@", 1)[0])
