# The released API's descriptor (docs/API.md, "Compatibility"): tests/python/test_proto_compat.py
# fails when proto/lce/v1/lce.proto breaks it. On a release, after the version bump:
#   cmake --build build --target lce_api_descriptor     (rewrites the checked-in file; commit it)
add_custom_target(lce_api_descriptor
  COMMAND protobuf::protoc --proto_path=${PROJECT_SOURCE_DIR}/proto --include_imports
          --descriptor_set_out=${PROJECT_SOURCE_DIR}/proto/lce/v1/lce.v1.descriptor.binpb lce/v1/lce.proto
  COMMENT "proto/lce/v1/lce.v1.descriptor.binpb from lce.proto (the released API, ${PROJECT_VERSION})"
  VERBATIM)
