from voice_server.scheduling.base import BaseScheduler, Compute, Emit, EmitKind, WorkItem, WorkKind
from voice_server.scheduling.simple import SimpleScheduler

__all__ = ["BaseScheduler", "Compute", "Emit", "EmitKind", "SimpleScheduler", "WorkItem", "WorkKind"]
