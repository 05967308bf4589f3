"""Token blobs keep logprobs as double precision, so a stored record reads back bit for bit.

A NeMo Gym `TokenEntry` carries its logprobs as Python floats, and its token-capture transport must
hand back the identical serialized entry on freeze; `real` (float32) would round them. A float32
value widens to double precision exactly, so writers that store float32 logprobs read back the same.

Revision ID: 0002_i15_token_logprobs_f8
Revises: 0002_i9b_append_keys
"""

from alembic import op

revision = "0002_i15_token_logprobs_f8"
down_revision = "0002_i12_policy_versions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE rollbook.token_blobs ALTER COLUMN logprobs TYPE double precision[]")


def downgrade() -> None:
    op.execute("ALTER TABLE rollbook.token_blobs ALTER COLUMN logprobs TYPE real[]")
