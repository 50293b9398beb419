"""Artifact store: every stage input and output is an fsspec URI (local path, file://, s3://, gs://, memory://).

A prefix becomes an artifact only when its `_MANIFEST.json` exists, and that file is written LAST, in one
atomic step (temp file + rename locally, one PUT on S3): files first, manifest second. A prefix without a
manifest is refused by every reader. The manifest's `fingerprint` (stage + config + input fingerprints +
code version) is what makes a rerun skip finished work: a stage whose output already holds a manifest with
the same fingerprint returns it untouched.

Versions: the current version lives at the prefix itself (an HF folder `from_pretrained` reads). A changed
config first keeps the committed version as `{prefix}/_versions/{fingerprint}/` (its manifest, written last),
so a model that took days is never destroyed and a downstream manifest's (uri, fingerprint) still resolves
(`read_version`, rlhf_core/store/versions.py). Keeping moves nothing large: on a local disk the files are hard
links; on an S3 bucket with versioning enabled the version stays in place (its manifest names each root
object's version id, `files_at`); only an unversioned bucket pays a server-side copy (logged once per bucket).
A config reverted to a kept fingerprint restores that version instead of redoing the work (`existing`).
Only `prune_versions` (`rlhf-flows gc URI --keep N`) deletes versions. A writer owns only
what it wrote: `_MANIFEST.json`, `_versions/`, `checkpoints/`, `_job/`, the files its manifests list and the names its
journal `_WRITING.json` recorded before writing them; any other file under `output_uri` is refused by name.

Credentials come from the environment only (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ... of the process,
which training jobs and Ray workers inherit; flows can fill it from a Prefect Secret block). `storage_options`
holds only non-secret settings (endpoint, region, timeouts): `check_no_secrets` refuses key/secret/token there,
because options travel as Prefect parameters (stored in its database, shown in the UI), spec files and Ray
actor arguments. Secrets never enter a manifest, a log line or an error message (see `redact`).

The parts: errors.py, uris.py (URIs, credentials, filesystems), manifest.py (the manifest, fingerprints, reading),
writer.py (ArtifactWriter), fence.py (the run lock's fence), locks.py (leases), versions.py (kept versions). This
module gathers their API: callers write `from rlhf_core import store` and `store.read_manifest(...)`.
"""
from rlhf_core.store.errors import (ArtifactError, ForeignFilesError, NotCommittedError, StageMismatchError,  # noqa: F401
                                    StoreUnreachableError)
from rlhf_core.store.locks import LockLost  # noqa: F401  (raised by every write of a process that lost its lock)
from rlhf_core.store.uris import (SECRET_ENV, SECRET_KEYS, check_no_secrets, check_reachable, endpoint_of,  # noqa: F401
                                  filesystem, join, redact, redact_error, run_prefix, storage_options_for)
from rlhf_core.store.manifest import (CODE_VERSION, JOURNAL, LOCK, LOCK_LEASE_S, MANIFEST, RESERVED, TEMPS,  # noqa: F401
                                      VERSIONS, Manifest, bucket_versioned, cache_root, cat_file, committed,
                                      committed_any, file_location, fingerprint, get_file, iter_batches, read_manifest,
                                      read_table, source_manifest, table_files, write_atomic)
from rlhf_core.store.fence import FENCE_ENV, artifact_lease, check_fence, fence  # noqa: F401
from rlhf_core.store.writer import ArtifactWriter, commit_model_dir  # noqa: F401
