# `cpack -G DEB` in the build directory: lce-serve_<version>_<arch>.deb with what `cmake --install`
# installs (under /usr) plus the systemd unit and its config (the component "service": a conffile
# that an upgrade keeps where the admin edited it). Its dependencies are dpkg-shlibdeps' reading of
# the binaries (libgrpc++1.51, libprotobuf32, libabsl20220623, libopenblas0, libssl3, ... on
# Debian 12); the headers' and archives' build dependencies are suggested.
set(CPACK_PACKAGE_NAME lce-serve)
set(CPACK_PACKAGE_VENDOR lce-serve)
set(CPACK_PACKAGE_CONTACT "lce-serve maintainers <lce-serve@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "fused linear cross-entropy LM head served over gRPC")
set(CPACK_PACKAGE_DESCRIPTION
    "lce_server holds the LM-head weight of a language model and answers per-token logprobs, entropy, loss and d_hidden over gRPC; lce_cli, the C++ client library and its CMake package come with it.")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_GENERATOR DEB)
# Everything `cmake --install` installs, plus the service's files.
set(CPACK_INSTALL_CMAKE_PROJECTS "${PROJECT_BINARY_DIR};${PROJECT_NAME};ALL;/"
                                 "${PROJECT_BINARY_DIR};${PROJECT_NAME};service;/")
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # lce-serve_<version>_<arch>.deb
set(CPACK_DEBIAN_PACKAGE_SECTION net)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "libgrpc++-dev, libprotobuf-dev, protobuf-compiler, libabsl-dev, libssl-dev, nlohmann-json3-dev, pkg-config")
set(LCE_DEB_CONTROL ${PROJECT_BINARY_DIR}/deb-control)
file(MAKE_DIRECTORY ${LCE_DEB_CONTROL})
file(WRITE ${LCE_DEB_CONTROL}/conffiles "/etc/lce-serve/lce-serve.conf\n")
file(COPY ${PROJECT_SOURCE_DIR}/deploy/systemd/postinst ${PROJECT_SOURCE_DIR}/deploy/systemd/prerm
          ${PROJECT_SOURCE_DIR}/deploy/systemd/postrm DESTINATION ${LCE_DEB_CONTROL}
     FILE_PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE WORLD_READ WORLD_EXECUTE)
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA ${LCE_DEB_CONTROL}/conffiles ${LCE_DEB_CONTROL}/postinst
                                       ${LCE_DEB_CONTROL}/prerm ${LCE_DEB_CONTROL}/postrm)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
include(CPack)
