"""The core: everything that needs only torch (and torchvision's model classes for repair).

Layout (:mod:`.layout`), the functional conversion (:mod:`.convert`), canonical checkpoints
(:mod:`.canonical_checkpoints`), the repair rules and layers (:mod:`.layers`), the layout audit
(:mod:`.audit`, :mod:`.model_audit`), auto mode (:mod:`.auto`, :mod:`.auto_mode`), what
parallel wrappers allow (:mod:`.weight_layout`), the framework-neutral event layer
(:mod:`.guard`), what a user sees of a run (:mod:`.console`), fused inference (:mod:`.fuse`),
known kernel bugs and the doctor (:mod:`.safety`), and interleaved timing (:mod:`.timing`).
Integrations and the application import from here; nothing here imports from them.
"""

from channels_last_algo.core.audit import AuditRecord, AuditReport, LayoutAudit, LayoutBreakError
from channels_last_algo.core.auto_mode import AutoMode, Trial
from channels_last_algo.core.canonical_checkpoints import canonical_state
from channels_last_algo.core.console import ConsoleBlock
from channels_last_algo.core.convert import ConversionSummary, apply_channels_first, apply_channels_last
from channels_last_algo.core.fuse import (
    FusedConv2d,
    FusedEvaluation,
    FusionSummary,
    InferenceModel,
    export_for_inference,
    fuse_for_inference,
)
from channels_last_algo.core.guard import LayoutGuard
from channels_last_algo.core.layers import RULES, RepairRule, repair_model
from channels_last_algo.core.layout import (
    Layout,
    batch_to_channels_last,
    has_channels_last_strides,
    is_channels_last,
    layout_of,
    to_channels_last,
)
from channels_last_algo.core.model_audit import audit_model
from channels_last_algo.core.safety import KNOWN_BUGS
from channels_last_algo.core.safety.diagnostics import DoctorReport, doctor
from channels_last_algo.core.swap_records import SwapRecord
from channels_last_algo.core.weight_layout import WeightLayoutPlan, weight_layout_for

__all__ = [
    'AuditRecord',
    'AuditReport',
    'AutoMode',
    'ConsoleBlock',
    'ConversionSummary',
    'DoctorReport',
    'FusedConv2d',
    'FusedEvaluation',
    'FusionSummary',
    'InferenceModel',
    'KNOWN_BUGS',
    'Layout',
    'LayoutAudit',
    'LayoutBreakError',
    'LayoutGuard',
    'RULES',
    'RepairRule',
    'SwapRecord',
    'Trial',
    'WeightLayoutPlan',
    'apply_channels_first',
    'apply_channels_last',
    'audit_model',
    'batch_to_channels_last',
    'canonical_state',
    'doctor',
    'export_for_inference',
    'fuse_for_inference',
    'has_channels_last_strides',
    'is_channels_last',
    'layout_of',
    'repair_model',
    'to_channels_last',
    'weight_layout_for',
]
