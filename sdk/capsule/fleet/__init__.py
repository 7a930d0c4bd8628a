"""capsule.fleet: a robot's committed capsules replicated to S3-compatible object storage, and back.

The durability point stays on the robot (the local store's commit); replication is asynchronous,
on its own thread, resumable and signed (docs/FORMAT.md, "Fleet replicas"):

    Session.open("robot.capsules", ..., replicate="s3://fleet/robot-7")   # background copies
    capsule pull s3://fleet/robot-7 new.capsules                          # another robot continues

Endpoint and credentials come from the standard AWS variables (AWS_ENDPOINT_URL, ...). boto3 is
imported only when a replica is opened (pip install 'exec-capsules[fleet]').
"""
from .bucket import Location, ObjectStore, S3Bucket, parse_url
from .config import Replication
from .errors import FleetConflict, FleetError, FleetKeyError, RemoteCorrupt, RemoteUnavailable
from .replicator import ReplicationStatus, Replicator
from .transfer import Pulled, Pushed, pull, push, remote_epochs

__all__ = ["Replication", "Replicator", "ReplicationStatus", "pull", "push", "remote_epochs", "Pulled", "Pushed",
           "ObjectStore", "S3Bucket", "Location", "parse_url", "FleetError", "FleetConflict", "FleetKeyError",
           "RemoteCorrupt", "RemoteUnavailable"]
