# Included by the install rules (deploy/install.cmake) at install time:
# `cmake --install build --prefix P` and cpack (prefix /usr, DESTDIR the
# package's staging tree). CMAKE_INSTALL_PREFIX is then the prefix being
# installed to, not the one configured, so the files whose text names
# installed paths (the unit's ExecStart, the pkg-config file) are written
# here, and the configuration goes where GNUInstallDirs would put it for
# that prefix: /etc for /usr (and /), PREFIX/etc otherwise.
#
# Set by the caller from configure time: FS_SOURCE_DIR, FS_BINARY_DIR,
# FS_VERSION and the GNUInstallDirs directories FS_BINDIR, FS_LIBDIR,
# FS_INCLUDEDIR, FS_SYSCONFDIR (relative to the prefix, or absolute).

# A relative --prefix is relative to where `cmake --install` runs; the
# unit and pkg-config file need it absolute.
get_filename_component(FORESHOCK_PREFIX "${CMAKE_INSTALL_PREFIX}" ABSOLUTE)

function(fs_prefixed out dir)
  if(IS_ABSOLUTE "${dir}")
    set(${out} "${dir}" PARENT_SCOPE)
  else()
    set(${out} "${FORESHOCK_PREFIX}/${dir}" PARENT_SCOPE)
  endif()
endfunction()

set(FORESHOCK_VERSION "${FS_VERSION}")
fs_prefixed(FORESHOCK_BINDIR "${FS_BINDIR}")
if(NOT IS_ABSOLUTE "${FS_SYSCONFDIR}" AND FORESHOCK_PREFIX MATCHES "^/(usr/?)?$")
  set(FORESHOCK_SYSCONFDIR /etc)
else()
  fs_prefixed(FORESHOCK_SYSCONFDIR "${FS_SYSCONFDIR}")
endif()
set(FORESHOCK_CONFIG "${FORESHOCK_SYSCONFDIR}/foreshock/foreshockd.conf")
# pkg-config keeps paths below the prefix relative to ${prefix}.
foreach(d LIBDIR INCLUDEDIR)
  if(IS_ABSOLUTE "${FS_${d}}")
    set(FORESHOCK_PC_${d} "${FS_${d}}")
  else()
    set(FORESHOCK_PC_${d} "\${prefix}/${FS_${d}}")
  endif()
endforeach()

# Writes TEMPLATE with the paths above into the build tree, installs it as
# DIR/NAME (DIR absolute, DESTDIR is prepended by file(INSTALL)), and
# removes the staged copy.
function(fs_install_configured template dir name)
  # Staged per prefix: a cpack and a `cmake --install --prefix P` may run at once.
  string(MD5 key "${FORESHOCK_PREFIX}")
  set(staged "${FS_BINARY_DIR}/install-prefixed/${name}.${key}")
  configure_file("${template}" "${staged}" @ONLY)
  file(INSTALL "${staged}" DESTINATION "${dir}" RENAME "${name}"
       PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
  file(REMOVE "${staged}")
endfunction()

# The configuration: the reference (every key commented, so the defaults)
# as foreshockd.conf, mode 0640 (it will hold tokens; the package gives its
# group to the foreshock user). An existing one is the operator's and is
# kept: installing again must not undo their edits (the package's copy is a
# dpkg conffile, which dpkg itself keeps).
function(fs_install_config)
  set(dir "${FORESHOCK_SYSCONFDIR}/foreshock")
  if(EXISTS "$ENV{DESTDIR}${dir}/foreshockd.conf")
    message(STATUS "Keeping: $ENV{DESTDIR}${dir}/foreshockd.conf (exists; the reference "
                   "is ${FS_SOURCE_DIR}/deploy/foreshockd.conf.example)")
    return()
  endif()
  file(INSTALL "${FS_SOURCE_DIR}/deploy/foreshockd.conf.example" DESTINATION "${dir}"
       RENAME foreshockd.conf PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ)
endfunction()
