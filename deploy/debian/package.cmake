# Debian packages from the install rules (deploy/install.cmake), one per
# component, built by CPack's DEB generator:
#
#   cpack --config build/CPackConfig.cmake -B OUTDIR
#
#   foreshockd        the daemon, its unit and sysusers file, the conffile
#                     /etc/foreshock/foreshockd.conf; maintainer scripts in
#                     deploy/debian/foreshockd/ (user, no start, purge)
#   foreshock         the CLI
#   libforeshock0     the client library (named for its soname, Debian's rule
#                     for library packages, so a future libforeshock1 can be
#                     installed beside it)
#   libforeshock-dev  header, link-time .so, pkg-config file
#
# Dependencies come from the binaries (dpkg-shlibdeps, from dpkg-dev), not a
# hand-kept list; the library package ships a shlibs file so that packages
# built against it get their dependency the same way.

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME foreshock)
set(CPACK_PACKAGE_VENDOR "Foreshock")
set(CPACK_PACKAGE_CONTACT "Foreshock developers <foreshock@example.org>")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_STRIP_FILES ON)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_ALL foreshockd foreshock libforeshock libforeshock-dev)

set(CPACK_DEBIAN_PACKAGE_RELEASE 1)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # NAME_VERSION-RELEASE_ARCH.deb
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY ">=")
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
# libforeshock-dev depends on the exact libforeshock0 it was built with.
set(CPACK_DEBIAN_ENABLE_COMPONENT_DEPENDS ON)
set(CPACK_COMPONENT_LIBFORESHOCK-DEV_DEPENDS libforeshock)

set(CPACK_DEBIAN_FORESHOCKD_PACKAGE_NAME foreshockd)
set(CPACK_DEBIAN_FORESHOCKD_PACKAGE_SECTION net)
# The postinst creates the user with systemd-sysusers, or adduser without it.
set(CPACK_DEBIAN_FORESHOCKD_PACKAGE_DEPENDS "adduser | systemd")
set(CPACK_DEBIAN_FORESHOCKD_PACKAGE_SUGGESTS foreshock)
set(CPACK_DEBIAN_FORESHOCKD_DESCRIPTION
  "training-run instability monitor (daemon)
foreshockd receives attention/router sketches and training scalars from
trainer ranks over TCP, stores every series in SQLite, runs the mechanism
monitors and detectors, pages, and serves an HTTP API, /metrics and a
dashboard. The service is installed disabled: configure
/etc/foreshock/foreshockd.conf, then systemctl enable --now foreshockd.")
set(CPACK_DEBIAN_FORESHOCKD_PACKAGE_CONTROL_EXTRA
    ${CMAKE_CURRENT_LIST_DIR}/foreshockd/conffiles
    ${CMAKE_CURRENT_LIST_DIR}/foreshockd/postinst
    ${CMAKE_CURRENT_LIST_DIR}/foreshockd/prerm
    ${CMAKE_CURRENT_LIST_DIR}/foreshockd/postrm)

set(CPACK_DEBIAN_FORESHOCK_PACKAGE_NAME foreshock)
set(CPACK_DEBIAN_FORESHOCK_PACKAGE_SECTION utils)
set(CPACK_DEBIAN_FORESHOCK_DESCRIPTION
  "training-run instability monitor (command-line client)
foreshock queries a foreshockd over HTTP (runs, series, alerts, silences),
simulates and replays training runs into it, and backtests detection on
stored series with the daemon's own code.")

set(CPACK_DEBIAN_LIBFORESHOCK_PACKAGE_NAME libforeshock0)
set(CPACK_DEBIAN_LIBFORESHOCK_PACKAGE_SECTION libs)
set(CPACK_DEBIAN_LIBFORESHOCK_DESCRIPTION
  "training-run instability monitor (client library)
libforeshock streams reports from trainer ranks to foreshockd: a background
I/O thread, a bounded replay buffer, reconnects and resume; the Python
client loads it through ctypes.")

set(CPACK_DEBIAN_LIBFORESHOCK-DEV_PACKAGE_NAME libforeshock-dev)
set(CPACK_DEBIAN_LIBFORESHOCK-DEV_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_LIBFORESHOCK-DEV_DESCRIPTION
  "training-run instability monitor (client library, development files)
The header foreshock.h, the link-time libforeshock.so and the pkg-config
file foreshock.pc.")

include(CPack)
