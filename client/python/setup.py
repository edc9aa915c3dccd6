"""Build hook: generates the gRPC stubs of proto/lce/v1/lce.proto with grpcio-tools.

The generated modules land in lce_client/_proto/ (git-ignored) both in the source tree and in the
build directory, so that regular, editable and sdist builds all ship them. The package's grpcio and
protobuf lower bounds are the versions of the code generator, because generated code refuses to
import on an older runtime.
"""
import os
import re
import shutil
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_REL = os.path.join("lce", "v1", "lce.proto")
OUT_DIR = os.path.join(HERE, "lce_client", "_proto")


def _proto_root():
    # ../../proto in the repository; ./proto inside an sdist.
    for cand in (os.path.join(HERE, "..", "..", "proto"), os.path.join(HERE, "proto")):
        if os.path.isfile(os.path.join(cand, PROTO_REL)):
            return os.path.abspath(cand)
    return None


def generate_stubs():
    root = _proto_root()
    if root is None:
        if os.path.isfile(os.path.join(OUT_DIR, "lce_pb2.py")):
            return  # already generated (e.g. unpacked from a built sdist)
        raise RuntimeError("lce_client: cannot find proto/lce/v1/lce.proto (looked in ../../proto and ./proto)")
    from grpc_tools import protoc
    import grpc_tools

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main([
            "grpc_tools.protoc", f"-I{root}", f"-I{include}",
            f"--python_out={tmp}", f"--grpc_python_out={tmp}", f"--pyi_out={tmp}",
            os.path.join(root, PROTO_REL),
        ])
        if rc != 0:
            raise RuntimeError(f"lce_client: grpc_tools.protoc failed with {rc}")
        os.makedirs(OUT_DIR, exist_ok=True)
        gen = os.path.join(tmp, "lce", "v1")
        for name in ("lce_pb2.py", "lce_pb2.pyi", "lce_pb2_grpc.py"):
            with open(os.path.join(gen, name)) as f:
                text = f.read()
            # The generator writes absolute imports ("from lce.v1 import lce_pb2"); make them relative.
            text = text.replace("from lce.v1 import lce_pb2", "from . import lce_pb2")
            with open(os.path.join(OUT_DIR, name), "w") as f:
                f.write(text)
    with open(os.path.join(OUT_DIR, "__init__.py"), "w") as f:
        f.write('"""Generated from proto/lce/v1/lce.proto at build time by setup.py; do not edit."""\n')


def _requirements():
    reqs = ["numpy>=1.22"]
    try:
        import grpc_tools  # noqa: F401 - whether it is installed
        from importlib.metadata import version

        tools = version("grpcio-tools")
        reqs.append(f"grpcio>={tools}")
    except Exception:
        reqs.append("grpcio>=1.62")
    pb = None
    gen = os.path.join(OUT_DIR, "lce_pb2.py")
    if os.path.isfile(gen):
        m = re.search(r"# Protobuf Python Version: (\d+)\.(\d+)\.(\d+)", open(gen).read())
        if m:
            pb = m.groups()
    if pb:
        reqs.append(f"protobuf>={pb[0]}.{pb[1]}.{pb[2]},<{int(pb[0]) + 1}")
    else:
        reqs.append("protobuf>=4.25")
    return reqs


class BuildPyWithStubs(build_py):
    def run(self):
        generate_stubs()
        super().run()
        # Also place the freshly generated files into the build directory (they are not tracked,
        # so package discovery may have run before they existed).
        if not getattr(self, "editable_mode", False):
            dst = os.path.join(self.build_lib, "lce_client", "_proto")
            os.makedirs(dst, exist_ok=True)
            for name in os.listdir(OUT_DIR):
                if name.endswith((".py", ".pyi")):
                    shutil.copy2(os.path.join(OUT_DIR, name), os.path.join(dst, name))


class SdistWithProto(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        root = _proto_root()
        if root:
            dst = os.path.join(base_dir, "proto", "lce", "v1")
            os.makedirs(dst, exist_ok=True)
            shutil.copy2(os.path.join(root, PROTO_REL), dst)


generate_stubs()
setup(install_requires=_requirements(), cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProto})
