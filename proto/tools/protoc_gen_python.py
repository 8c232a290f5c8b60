"""protoc plugin that generates deltagym's Python code with grpcio-tools.

buf runs this as a local plugin (see buf.gen.yaml) with the project venv's
Python. It hands the request's files to the protoc bundled in grpcio-tools to
produce messages (*_pb2.py), type stubs (*_pb2.pyi) and gRPC stubs
(*_pb2_grpc.py, for files with services), then rewrites their imports of the API's own modules so that
the code lives inside a package instead of at the top level:

    from deltagym.v1 import action_pb2
becomes
    from deltagym._proto.deltagym.v1 import action_pb2

The prefix comes from the plugin option import_prefix (default
"deltagym._proto"). Empty __init__.py files are added to every generated
directory and to the output root, so that the tree is a regular package.
"""

import os
import re
import sys
import tempfile

from google.protobuf import descriptor_pb2
from google.protobuf.compiler import plugin_pb2
from grpc_tools import protoc


def _options(parameter):
    opts = {"import_prefix": "deltagym._proto"}
    for item in filter(None, parameter.split(",")):
        key, _, value = item.partition("=")
        if key not in opts:
            raise ValueError("unknown option %r" % key)
        opts[key] = value
    return opts


def _generate(request):
    opts = _options(request.parameter)
    # The packages of the files being generated; imports of other packages
    # (google.protobuf) are left alone.
    packages = sorted(
        {os.path.dirname(name).replace("/", ".") for name in request.file_to_generate},
        key=len,
        reverse=True,
    )
    pattern = re.compile(
        r"^(from|import) (%s)(\b)" % "|".join(re.escape(p) for p in packages),
        re.MULTILINE,
    )
    # grpc_tools writes a *_pb2_grpc.py for every file; keep only those of
    # files that define services.
    without_services = {
        f.name[: -len(".proto")] + "_pb2_grpc.py"
        for f in request.proto_file
        if f.name in request.file_to_generate and not f.service
    }
    fds = descriptor_pb2.FileDescriptorSet()
    fds.file.extend(request.proto_file)
    response = plugin_pb2.CodeGeneratorResponse()
    response.supported_features = plugin_pb2.CodeGeneratorResponse.FEATURE_PROTO3_OPTIONAL
    with tempfile.TemporaryDirectory() as tmp:
        fds_path = os.path.join(tmp, "in.binpb")
        with open(fds_path, "wb") as f:
            f.write(fds.SerializeToString())
        out = os.path.join(tmp, "out")
        os.mkdir(out)
        args = [
            "grpc_tools.protoc",
            "--descriptor_set_in=" + fds_path,
            "--python_out=" + out,
            "--pyi_out=" + out,
            "--grpc_python_out=" + out,
        ] + list(request.file_to_generate)
        if protoc.main(args) != 0:
            response.error = "grpc_tools.protoc failed (see its messages above)"
            return response
        dirs = {""}
        for root, _, files in os.walk(out):
            for name in sorted(files):
                rel = os.path.relpath(os.path.join(root, name), out)
                if rel in without_services:
                    continue
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    text = f.read()
                text = pattern.sub(
                    lambda m: "%s %s.%s%s" % (m.group(1), opts["import_prefix"], m.group(2), m.group(3)),
                    text,
                )
                response.file.add(name=rel, content=text)
                d = os.path.dirname(rel)
                while d:
                    dirs.add(d)
                    d = os.path.dirname(d)
        for d in sorted(dirs):
            response.file.add(name=os.path.join(d, "__init__.py"), content="")
    return response


def main():
    request = plugin_pb2.CodeGeneratorRequest.FromString(sys.stdin.buffer.read())
    sys.stdout.buffer.write(_generate(request).SerializeToString())


if __name__ == "__main__":
    main()
