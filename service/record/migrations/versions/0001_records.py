"""The first schema: records, their reviews, and what stored pictures hold.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None


def upgrade() -> None:
    op.create_table(
        "records",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("time", sa.Float, nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("raw_score", sa.Float, nullable=False),
        sa.Column("score", sa.Float, nullable=False),
        sa.Column("threshold", sa.Float, nullable=False),
        sa.Column("raw_threshold", sa.Float, nullable=True),
        sa.Column("is_anomaly", sa.Boolean, nullable=False),
        sa.Column("anomalous_area", sa.Float, nullable=False),
        sa.Column("input_distance", sa.Float, nullable=True),
        sa.Column("width", sa.Integer, nullable=False),
        sa.Column("height", sa.Integer, nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("picture_bytes", sa.Integer, nullable=False),
        sa.Column("fields", sa.JSON, nullable=False),
        sa.Column("part", sa.String(256), nullable=True),
        sa.Column("source", sa.String(32), nullable=False),
        sa.Column("sampled", sa.Boolean, nullable=False),
        sa.Column("label", sa.String(16), nullable=True),
        sa.Column("reviewed_at", sa.Float, nullable=True),
    )
    op.create_index("ix_records_time", "records", ["time"])
    op.create_index("ix_records_sha256", "records", ["sha256"])
    op.create_index("ix_records_part", "records", ["part"])
    op.create_index("ix_records_model_version", "records", ["model", "version"])
    op.create_index("ix_records_label", "records", ["label"])
    op.create_table(
        "reviews",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("record_id", sa.String(32), sa.ForeignKey("records.id", ondelete="CASCADE"), nullable=False),
        sa.Column("time", sa.Float, nullable=False),
        sa.Column("label", sa.String(16), nullable=False),
        sa.Column("defect_type", sa.String(64), nullable=True),
        sa.Column("note", sa.Text, nullable=True),
        sa.Column("reviewer", sa.String(128), nullable=True),
    )
    op.create_index("ix_reviews_record_id", "reviews", ["record_id"])
    op.create_table(
        "pictures",
        sa.Column("sha256", sa.String(64), primary_key=True),
        sa.Column("bytes", sa.Integer, nullable=False),
        sa.Column("first_seen", sa.Float, nullable=False),
        sa.Column("last_seen", sa.Float, nullable=False),
        sa.Column("flagged", sa.Boolean, nullable=False),
        sa.Column("pinned", sa.Boolean, nullable=False),
        sa.Column("evicted", sa.Float, nullable=True),
    )
    op.create_index("ix_pictures_last_seen", "pictures", ["last_seen"])


def downgrade() -> None:
    op.drop_table("pictures")
    op.drop_table("reviews")
    op.drop_table("records")
