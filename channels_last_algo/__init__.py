"""Train conv nets in channels-last (NHWC) memory format, and keep them there.

Example:
    >>> from channels_last_algo import ChannelsLast, apply_channels_last
"""

__version__ = '0.1.0'

from channels_last_algo.algorithm import ChannelsLast
from channels_last_algo.audit import AuditRecord, AuditReport, LayoutAudit, LayoutBreakError, audit_model
from channels_last_algo.convert import ConversionSummary, apply_channels_last
from channels_last_algo.fuse import (
    FusedConv2d,
    FusedEvaluation,
    FusionSummary,
    InferenceModel,
    export_for_inference,
    fuse_for_inference,
)
from channels_last_algo.guard import LayoutGuard, batch_to_channels_last
from channels_last_algo.layers import RULES, RepairRecord, RepairRule, repair_model
from channels_last_algo.parallel import WeightLayoutPlan, weight_layout_for
from channels_last_algo.layout import Layout, has_channels_last_strides, is_channels_last, layout_of, to_channels_last

__all__ = [
    'AuditRecord',
    'AuditReport',
    'LayoutAudit',
    'LayoutBreakError',
    'audit_model',
    'ChannelsLast',
    'ConversionSummary',
    'FusedConv2d',
    'FusedEvaluation',
    'FusionSummary',
    'InferenceModel',
    'export_for_inference',
    'fuse_for_inference',
    'Layout',
    'LayoutGuard',
    'apply_channels_last',
    'batch_to_channels_last',
    'has_channels_last_strides',
    'is_channels_last',
    'layout_of',
    'to_channels_last',
    'RULES',
    'RepairRecord',
    'RepairRule',
    'repair_model',
    'WeightLayoutPlan',
    'weight_layout_for',
]
