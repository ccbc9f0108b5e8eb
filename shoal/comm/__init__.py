"""Moving tensors between workers; knows no training algorithm."""

from shoal.comm.group import Group, Handle
from shoal.comm.meter import CommCounters, CommStats, Meter, StepMeter, wire_bytes
from shoal.comm.topology import HostGroups, Topology, discover, host_identity
from shoal.comm.world import init

__all__ = ["Group", "Handle", "Meter", "StepMeter", "CommCounters", "CommStats", "wire_bytes", "init",
           "Topology", "HostGroups", "discover", "host_identity"]
