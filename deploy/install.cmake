# Install rules (included by the top-level CMakeLists.txt). Four components,
# which are also the Debian packages (deploy/debian/package.cmake):
#
#   foreshockd        bin/foreshockd, lib/systemd/system/foreshockd.service,
#                     lib/sysusers.d/foreshock.conf, etc/foreshock/foreshockd.conf
#   foreshock         bin/foreshock (the CLI; libforeshock is linked in)
#   libforeshock      libforeshock.so.0 (+ .so.0.1.0): the client library
#                     that C/C++ trainers and the Python wheel load
#   libforeshock-dev  include/foreshock.h, libforeshock.so, pkgconfig/foreshock.pc
#
# `cmake --install build --prefix P` gives a tree that works from P: the
# unit's ExecStart is P/bin/foreshockd --config P/etc/foreshock/foreshockd.conf
# (for P = /usr: /etc/foreshock/...). Those paths are only known at install
# time, so deploy/install_prefixed.cmake writes those files then. The
# dashboard needs nothing installed: its assets are embedded in foreshockd
# (dashboard_assets.c), as are the schema migrations.
#
# Unit and sysusers file go below PREFIX/lib (not LIBDIR, which is
# multiarch on Debian for /usr): systemd reads units from /usr/lib/systemd
# and /usr/local/lib/systemd, systemd-sysusers from /usr/lib/sysusers.d and
# /usr/local/lib/sysusers.d.

set(FS_INSTALL_PREFIXED_INIT "
  set(FS_SOURCE_DIR \"${CMAKE_SOURCE_DIR}\")
  set(FS_BINARY_DIR \"${CMAKE_BINARY_DIR}\")
  set(FS_VERSION \"${PROJECT_VERSION}\")
  set(FS_BINDIR \"${CMAKE_INSTALL_BINDIR}\")
  set(FS_LIBDIR \"${CMAKE_INSTALL_LIBDIR}\")
  set(FS_INCLUDEDIR \"${CMAKE_INSTALL_INCLUDEDIR}\")
  set(FS_SYSCONFDIR \"${CMAKE_INSTALL_SYSCONFDIR}\")
  include(\"${CMAKE_SOURCE_DIR}/deploy/install_prefixed.cmake\")")

# The daemon.
if(TARGET foreshockd)
  install(TARGETS foreshockd RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT foreshockd)
  install(FILES ${CMAKE_SOURCE_DIR}/deploy/systemd/foreshock.sysusers.conf
          DESTINATION lib/sysusers.d RENAME foreshock.conf COMPONENT foreshockd)
  install(CODE "${FS_INSTALL_PREFIXED_INIT}
    fs_install_configured(\"${CMAKE_SOURCE_DIR}/deploy/systemd/foreshockd.service.in\"
                          \"\${FORESHOCK_PREFIX}/lib/systemd/system\" foreshockd.service)
    fs_install_config()" COMPONENT foreshockd)
endif()

# The CLI.
if(TARGET foreshock_cli)
  install(TARGETS foreshock_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT foreshock)
endif()

# The client library: the versioned file and its soname link at run time,
# the unversioned link (what -lforeshock finds), header and pkg-config file
# for building against it.
if(TARGET foreshock)
  install(TARGETS foreshock
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT libforeshock
                  NAMELINK_COMPONENT libforeshock-dev)
  install(FILES ${CMAKE_SOURCE_DIR}/client/include/foreshock.h
          DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT libforeshock-dev)
  install(CODE "${FS_INSTALL_PREFIXED_INIT}
    fs_prefixed(pcdir \"${CMAKE_INSTALL_LIBDIR}/pkgconfig\")
    fs_install_configured(\"${CMAKE_SOURCE_DIR}/deploy/foreshock.pc.in\" \"\${pcdir}\" foreshock.pc)"
    COMPONENT libforeshock-dev)

  # The Python wheel, carrying the installed library (client/python/setup.py):
  # build/dist/foreshock-VERSION-py3-none-PLATFORM.whl
  add_custom_target(python-wheel
    COMMAND ${FORESHOCK_PYTHON} ${CMAKE_SOURCE_DIR}/client/python/build_wheel.py
            --build-dir ${CMAKE_BINARY_DIR} --out ${CMAKE_BINARY_DIR}/dist
    DEPENDS foreshock
    COMMENT "python wheel with libforeshock"
    VERBATIM)
endif()
