"""The fault-tolerance trainer (ft_workers.py) on backend "nccl" over the fake NCCL of
the test process (fake_nccl_remote.FakeNcclServer at KILN_FAKE_NCCL).

    python nccl_ft_workers.py nccl_trainer UID WORLD STORE_ADDR RESULT_JSON ARGS_JSON

The result adds "nccl": how this process made each of its communicators (init, split,
shrink, grow, join), from its NcclGroups.
"""

from __future__ import annotations

import functools
import os

import ft_workers
import kiln.distributed as dist
from kiln.distributed.nccl_groups import set_nccl_api
from tests.distributed.fake_nccl_remote import RemoteNccl
from workers import SCENARIOS, main

GROUPS = set_nccl_api(RemoteNccl(os.environ["KILN_FAKE_NCCL"]))
# the trainer's own init_process_group call, on nccl
dist.init_process_group = functools.partial(dist.init_process_group, "nccl")


def nccl_trainer(uid, world, addr, args):
    data = ft_workers.trainer(uid, world, addr, args)
    data["nccl"] = [dict(h) for h in GROUPS.history]
    data["backend"] = "nccl"
    return data


SCENARIOS["nccl_trainer"] = nccl_trainer

if __name__ == "__main__":
    main()
