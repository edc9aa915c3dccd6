# What `cmake --install` puts where (GNUInstallDirs), and the package a C++ program builds against:
#   bin/      lce_server, lce_cli and the launchers lce_tp_launch.sh, lce_dp_launch.sh
#   lib/      liblce_client.a, liblce_proto.a (the client and the generated API it is built on),
#             cmake/lce_serve/ (find_package(lce_serve CONFIG) -> lce::client) and
#             pkgconfig/lce-client.pc
#   include/  lce/client/lce_client.h and the generated lce/v1/lce.pb.h, lce.grpc.pb.h it includes
# The service's systemd unit and default config are the component "service", absolute paths
# (/lib/systemd/system, /etc/lce-serve) that only the .deb installs (cmake/LceCPack.cmake): a plain
# `cmake --install` into a prefix leaves /etc alone.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(LCE_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/lce_serve)

# Programs.
install(TARGETS lce_server lce_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT server)
install(PROGRAMS ${PROJECT_SOURCE_DIR}/deploy/lce_tp_launch.sh ${PROJECT_SOURCE_DIR}/deploy/lce_dp_launch.sh
        DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT server)

# The client library: static archives; their dependencies' targets come from lce_serveConfig.cmake.
set_target_properties(lce_client PROPERTIES EXPORT_NAME client)
set_property(TARGET lce_client APPEND PROPERTY INTERFACE_COMPILE_FEATURES cxx_std_20)  # as the project builds it
set_target_properties(lce_proto PROPERTIES EXPORT_NAME proto)
install(TARGETS lce_client lce_proto EXPORT lce_serveTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT client
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT client
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES ${PROJECT_SOURCE_DIR}/client/include/lce/client/lce_client.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/lce/client COMPONENT client)
install(FILES ${PROJECT_BINARY_DIR}/proto/gen/lce/v1/lce.pb.h ${PROJECT_BINARY_DIR}/proto/gen/lce/v1/lce.grpc.pb.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/lce/v1 COMPONENT client)
install(EXPORT lce_serveTargets NAMESPACE lce:: DESTINATION ${LCE_CMAKE_DIR} COMPONENT client)
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/lce_serveConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/lce_serveConfig.cmake INSTALL_DESTINATION ${LCE_CMAKE_DIR})
# Within a major version the API stays compatible (docs/API.md, "Compatibility").
write_basic_package_version_file(${PROJECT_BINARY_DIR}/lce_serveConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/lce_serveConfig.cmake ${PROJECT_BINARY_DIR}/lce_serveConfigVersion.cmake
        DESTINATION ${LCE_CMAKE_DIR} COMPONENT client)
string(REGEX REPLACE "[^/]+" ".." LCE_PC_UP "${CMAKE_INSTALL_LIBDIR}/pkgconfig")  # back up to the prefix
configure_file(${CMAKE_CURRENT_LIST_DIR}/lce-client.pc.in ${PROJECT_BINARY_DIR}/lce-client.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/lce-client.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT client)

install(FILES ${PROJECT_SOURCE_DIR}/README.md ${PROJECT_SOURCE_DIR}/CHANGELOG.md ${PROJECT_SOURCE_DIR}/docs/INSTALL.md
        DESTINATION ${CMAKE_INSTALL_DATAROOTDIR}/doc/lce-serve COMPONENT server)

# The service (the .deb only): systemd unit, and the flags it starts lce_server with (a conffile).
install(FILES ${PROJECT_SOURCE_DIR}/deploy/systemd/lce-serve.service DESTINATION /lib/systemd/system
        COMPONENT service EXCLUDE_FROM_ALL)
install(FILES ${PROJECT_SOURCE_DIR}/deploy/systemd/lce-serve.conf DESTINATION /etc/lce-serve
        COMPONENT service EXCLUDE_FROM_ALL)
