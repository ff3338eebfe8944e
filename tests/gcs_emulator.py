"""The GCS emulator the Cloud Storage tests start: gcp-storage-emulator (JSON API, in memory), with
the generation headers of a media download that Cloud Storage sends and TensorStore's OCDBT driver
needs for its conditional writes (``x-goog-generation``, ``x-goog-metageneration``), which this
emulator leaves out.

    python tests/gcs_emulator.py PORT
"""

import sys

from gcp_storage_emulator.handlers import objects


def _with_generation(download):
    def handler(request, response, storage, *args, **kwargs):
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except Exception:  # not found: the emulator answers 404 itself
            obj = None
        if obj is not None:
            response["x-goog-generation"] = str(obj["generation"])
            response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
        return download(request, response, storage, *args, **kwargs)

    return handler


objects.download = _with_generation(objects.download)

if __name__ == "__main__":
    from gcp_storage_emulator.__main__ import main  # imports the server (and its handler table) now

    main(["start", "--host", "127.0.0.1", "--port", sys.argv[1], "--in-memory", "--default-bucket", "bkt"])
