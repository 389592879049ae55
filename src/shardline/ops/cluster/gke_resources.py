"""Plan steps for what the jobs use besides the cluster: the training image (Artifact Registry + Cloud Build), the
GCS buckets with their Workload Identity bindings, and the Kubernetes Secrets `launch.kubernetes.secret_env` reads."""

from __future__ import annotations

from shardline.ops.cluster.gke_script import QUIET, P, Step, cmd, indent
from shardline.spec import JobSpec

IMAGE_FILE = "image.txt"
"""Written by setup.sh: the `--set launch.image=… --set launch.image_digest=…` flags of the built image."""


def repository_step() -> Step:
    where = f'"${{REPOSITORY}}" {P} --location "${{REGION}}"'
    return Step("Artifact Registry Docker repository for the training image",
                cmd("gcloud artifacts repositories create", where, "--repository-format docker"),
                exists=f"gcloud artifacts repositories describe {where}",
                delete=cmd("gcloud artifacts repositories delete", where, QUIET))


def build_step() -> Step:
    """Cloud Build with the checkout's cloudbuild.yaml; the image is tagged with the commit, so a commit that was
    built already is not built again, and its digest pins the launch (`launch.image_digest`)."""
    image = '"${REGION}-docker.pkg.dev/${PROJECT}/${REPOSITORY}/shardline:${GIT_COMMIT:0:12}"'
    substitutions = '"_REGION=${REGION},_REPOSITORY=${REPOSITORY},_TAG=${GIT_COMMIT:0:12},_GIT_COMMIT=${GIT_COMMIT}"'
    build = cmd('gcloud builds submit "${SOURCE_DIR}"', P, '--config "${SOURCE_DIR}/cloudbuild.yaml"',
                "--substitutions", substitutions)
    digest = 'DIGEST="$(gcloud artifacts docker images describe "${IMAGE}" --format "value(image_summary.digest)")"'
    return Step(
        "the training image: Cloud Build builds the Dockerfile (cloudbuild.yaml) once per commit; its digest pins "
        "launches",
        "\n".join([
            'GIT_COMMIT="$(git -C "${SOURCE_DIR}" rev-parse HEAD)"', f"IMAGE={image}",
            'if ! gcloud artifacts docker images describe "${IMAGE}" >/dev/null 2>&1; then',
            indent(build, "  "), "fi", digest,
            'echo "--set launch.image=${IMAGE} --set launch.image_digest=${DIGEST}"'
            f' | tee "${{HERE}}/{IMAGE_FILE}"',
        ]))


def secrets_step(spec: JobSpec) -> Step:
    """Each Secret the pods read, created from `<ENV>_FILE` when it names a file, else from the variable <ENV> in
    setup.sh's environment. The value only passes through a pipe (process substitution): it is in no argument,
    no file and no trace (the script never sets -x)."""
    namespace = '--namespace "${NAMESPACE}"'
    by_secret: dict[str, list[tuple[str, str]]] = {}
    for env, ref in sorted(spec.launch.kubernetes.secret_env.items()):
        by_secret.setdefault(ref.secret, []).append((ref.key, env))
    # $1: the environment variable, $2: a file to read instead (may be empty). A process substitution's failure
    # goes unnoticed, so the source is checked first: a missing token stops setup, never makes an empty Secret.
    lines = ["check_secret_source() {",
             '  if [[ -n "$2" && ! -r "$2" ]]; then echo "cannot read ${1}_FILE=$2" >&2; return 1; fi',
             '  if [[ -z "$2" && -z "${!1:-}" ]]; then echo "export $1 or set ${1}_FILE" >&2; return 1; fi',
             "}",
             "secret_value() {",
             '  if [[ -n "$2" ]]; then cat -- "$2"; else printf "%s" "${!1}"; fi',
             "}"]
    for secret, keys in by_secret.items():
        sources = [f'--from-file={key}=<(secret_value {env} "${{{env}_FILE}}")' for key, env in keys]
        lines += [f'if ! kubectl get secret "{secret}" {namespace} >/dev/null 2>&1; then',
                  *(f'  check_secret_source {env} "${{{env}_FILE}}"' for _, env in keys),
                  indent(cmd(f'kubectl create secret generic "{secret}"', namespace, *sources), "  "), "fi"]
    return Step("Kubernetes Secrets the pods read (launch.kubernetes.secret_env), from a file or the environment",
                "\n".join(lines))


def bucket_step(var: str) -> Step:
    bucket = f'"gs://${{{var}}}"'
    return Step(f"GCS bucket gs://${{{var}}}: hierarchical namespace (fast renames for checkpoints), uniform access",
                cmd("gcloud storage buckets create", bucket, P, '--location="${REGION}"',
                    "--uniform-bucket-level-access", "--enable-hierarchical-namespace"),
                exists=f"gcloud storage buckets describe {bucket} {P}",
                keep=f"gs://${{{var}}} holds the runs and checkpoints; delete it yourself: "
                     f"gcloud storage rm --recursive gs://${{{var}}}")


def bucket_binding_step(var: str) -> Step:
    member = ('"principal://iam.googleapis.com/projects/${PROJECT_NUMBER}/locations/global/workloadIdentityPools/'
              '${PROJECT}.svc.id.goog/subject/ns/${NAMESPACE}/sa/${KSA}"')

    def binding(verb: str) -> str:
        return cmd(f"gcloud storage buckets {verb}-iam-policy-binding", f'"gs://${{{var}}}"', "--member", member,
                   "--role roles/storage.objectUser")

    number = 'PROJECT_NUMBER="$(gcloud projects describe "${PROJECT}" --format "value(projectNumber)")"'
    return Step(
        f"GCS bucket gs://${{{var}}} access for the trainer's Kubernetes service account (Workload Identity, no GSA)",
        number + "\n" + binding("add"),  # adding a binding that is there already is a no-op
        delete_if=f'gcloud storage buckets describe "gs://${{{var}}}"',
        # Removing a binding that is not there fails; an absent binding is what teardown wants.
        delete=number + "\n" + binding("remove") + " || true")


def buckets(spec: JobSpec) -> dict[str, tuple[str, str]]:
    """Script variable → (bucket, the spec field naming it): the GCS FUSE mount, then a gs:// checkpoint.dir."""
    out: dict[str, tuple[str, str]] = {}
    storage = spec.launch.kubernetes.storage
    if storage.kind == "gcsfuse" and storage.bucket:
        out["BUCKET"] = (storage.bucket, "launch.kubernetes.storage.bucket")
    ckpt = spec.checkpoint.dir or ""
    if ckpt.startswith("gs://"):
        bucket = ckpt.removeprefix("gs://").split("/", 1)[0]
        if bucket not in {b for b, _ in out.values()}:
            out["CHECKPOINT_BUCKET"] = (bucket, "checkpoint.dir")
    return out
