# rekv — top-level build. `make` builds every program into build/bin/, `make test` builds and runs
# every test (`make test-quick` without the virtual-machine cases, `make test-vm` only those; see
# "Tests" below), `make CUDA=0` forces a CPU-only build, `make V=1` shows full commands.
#
# Layout: each room (a module folder: common, loader, gpuworker/device, kvstore, gpuworker,
# coordinator, coordinator/cli) becomes a static library of its .c files, except files named
# *_main.c, which are programs; with CUDA the .cu files become the cuda backend's shared object. Each program links only the rooms it may use (DEVELOPERS.md
# "Rooms"), so an arrow drawn the wrong way fails at link time as well as in tests/check_rooms.sh.
# proto/*.proto are compiled by protoc-c into build/gen/proto. tests/test_*.c are Check suites,
# one program each.

V ?= 0
ifeq ($(V),0)
Q := @
say = @printf '  %-7s %s\n' $(1) $(2);
else
Q :=
say =
endif

NVCC ?= $(or $(shell command -v nvcc 2>/dev/null),$(wildcard /usr/local/cuda/bin/nvcc))
NVCC := $(NVCC)
# The toolkit's root: $CUDA_HOME if set, else the one nvcc itself reports (nvcc on PATH may be a
# wrapper script elsewhere), else /usr/local/cuda; the first that has the runtime headers wins.
cuda_top = $(shell $(NVCC) --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$$ TOP=//p' | head -n1)
CUDA_HOME := $(firstword $(foreach d,$(CUDA_HOME) $(if $(NVCC),$(abspath $(cuda_top))) /usr/local/cuda,\
               $(if $(wildcard $(d)/include/cuda_runtime.h),$(d))))
CUDA ?= $(if $(and $(NVCC),$(CUDA_HOME)),1,0)

BUILD ?= build
export REKV_BUILD := $(BUILD)
CC ?= cc
PKGS := jansson libpcre2-8 libzmq liburing libprotobuf-c libsystemd libutf8proc libmicrohttpd hiredis msgpack
# OpenBLAS and LAPACKE: headers only; loaded on first use (gpuworker/blas.h says why)
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS) openblas 2>/dev/null)
PKG_LIBS := $(shell pkg-config --libs $(PKGS) 2>/dev/null)
CHECK_LIBS := $(shell pkg-config --libs check 2>/dev/null)

WARN := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wno-unused-parameter
CFLAGS ?= -O2 -g
ALL_CFLAGS := -std=gnu11 $(WARN) $(CFLAGS) -I. -I$(BUILD)/gen $(PKG_CFLAGS) -MMD -MP -fPIC
LDLIBS := $(PKG_LIBS) -lpthread -ldl -lm

# room -> folder; the library of room R is $(BUILD)/lib/librekv_R.a
MODULES := common proto loader device kvstore gpuworker coordinator cli
DIR_common := common
DIR_loader := loader
DIR_device := gpuworker/device
DIR_kvstore := kvstore
DIR_gpuworker := gpuworker
DIR_coordinator := coordinator
DIR_cli := coordinator/cli

PROTOS := $(wildcard proto/*.proto)
PROTO_C := $(patsubst proto/%.proto,$(BUILD)/gen/proto/%.pb-c.c,$(PROTOS))
PROTO_H := $(PROTO_C:.c=.h)

lib_srcs = $(filter-out %_main.c,$(wildcard $(1)/*.c))
lib_objs = $(patsubst %.c,$(BUILD)/obj/%.o,$(call lib_srcs,$(1)))
$(foreach m,$(filter-out proto,$(MODULES)),$(eval OBJS_$(m) := $(call lib_objs,$(DIR_$(m)))))
OBJS_proto := $(patsubst $(BUILD)/gen/%.c,$(BUILD)/obj/gen/%.o,$(PROTO_C))

# With CUDA, the cuda backend — the runtime (gpuworker/device/*.cu) and the engine's kernels
# (gpuworker/*.cu) — is one shared object, $(CUDA_SO), the only thing that links cudart and cuBLAS;
# programs load it on first use of the cuda backend (gpuworker/device/backend_cuda.h). It takes
# what it needs of the device and common rooms from their archives, and exports one symbol.
CUDA_SO :=
ifeq ($(CUDA),1)
# SASS for sm_80 (A100) and sm_90 (H100/H200) plus compute_90 PTX, which the driver JIT-compiles on a
# newer GPU (without it a newer GPU cannot run the build); -lineinfo maps ncu and compute-sanitizer
# reports to source lines at no cost in speed.
NVCCFLAGS := -O2 -std=c++17 -I. -I$(BUILD)/gen -Xcompiler -fPIC,-Wall,-Werror -Werror all-warnings \
             -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
             -gencode arch=compute_90,code=compute_90 -lineinfo
CUDA_OBJS := $(patsubst %.cu,$(BUILD)/obj/%.cu.o,$(wildcard gpuworker/device/*.cu gpuworker/*.cu))
CUDA_SO := $(BUILD)/lib/rekv/librekv_cuda.so
ALL_CFLAGS += -DREKV_CUDA=1
endif

# What each program links, users before what they use (linked as a group).
ROOMS_rekv := cli coordinator gpuworker kvstore device loader proto common
ROOMS_rekv-loader := loader common
ROOMS_rekv-kvstore := kvstore device loader proto common
ROOMS_rekv-coordinator := coordinator loader proto common
ROOMS_rekv-gpuworker := gpuworker kvstore device loader proto common
ROOMS_tests := cli coordinator gpuworker kvstore device loader proto common
room_libs = $(foreach m,$(ROOMS_$(1)),$(BUILD)/lib/librekv_$(m).a)
room_ldlibs = $(LDLIBS)

# programs: name -> main file
PROGRAMS := rekv rekv-loader
MAIN_rekv := coordinator/cli/rekv_main.c
MAIN_rekv-loader := loader/rekv_loader_main.c
ifneq ($(wildcard kvstore/kvstore_main.c),)
PROGRAMS += rekv-kvstore
MAIN_rekv-kvstore := kvstore/kvstore_main.c
endif
ifneq ($(wildcard coordinator/coordinator_main.c),)
PROGRAMS += rekv-coordinator
MAIN_rekv-coordinator := coordinator/coordinator_main.c
endif
ifneq ($(wildcard gpuworker/worker_main.c),)
PROGRAMS += rekv-gpuworker
MAIN_rekv-gpuworker := gpuworker/worker_main.c
endif
BINS := $(addprefix $(BUILD)/bin/,$(PROGRAMS))

TEST_SRCS := $(wildcard tests/test_*.c)
TEST_BINS := $(patsubst tests/%.c,$(BUILD)/tests/%,$(TEST_SRCS))
TEST_SUPPORT := $(filter-out tests/test_% tests/fuzz_%,$(wildcard tests/*.c))
TEST_SUPPORT_OBJS := $(patsubst %.c,$(BUILD)/obj/%.o,$(TEST_SUPPORT))

.PHONY: all test test-quick test-vm clean fuzz format install
# keep objects and generated headers that only feed other targets
.SECONDARY:
all: $(BINS) $(CUDA_SO)

# The version: common/version.h's release, and from a git checkout `git describe` of the tree,
# passed to common/version.c alone; a stamp rewritten only when the describe changes rebuilds it.
GIT_DESCRIBE := $(if $(wildcard .git),$(shell git describe --always --dirty 2>/dev/null))
$(BUILD)/gen/git-describe: FORCE
	$(Q)mkdir -p $(@D) && (echo '$(GIT_DESCRIBE)' | cmp -s - $@ || echo '$(GIT_DESCRIBE)' > $@)
$(BUILD)/obj/common/version.o: $(BUILD)/gen/git-describe
$(BUILD)/obj/common/version.o: ALL_CFLAGS += $(if $(GIT_DESCRIBE),-DREKV_GIT_DESCRIBE='"$(GIT_DESCRIBE)"')
.PHONY: FORCE
FORCE:

$(BUILD)/gen/proto/%.pb-c.c $(BUILD)/gen/proto/%.pb-c.h: proto/%.proto
	$(call say,PROTOC,$<)
	$(Q)mkdir -p $(BUILD)/gen/proto && protoc-c --proto_path=. --c_out=$(BUILD)/gen $<

# every object may include generated protobuf headers
$(BUILD)/obj/%.o: %.c | $(PROTO_H)
	$(call say,CC,$<)
	$(Q)mkdir -p $(@D) && $(CC) $(ALL_CFLAGS) -c $< -o $@

$(BUILD)/obj/gen/%.o: $(BUILD)/gen/%.c
	$(call say,CC,$<)
	$(Q)mkdir -p $(@D) && $(CC) $(filter-out -Werror,$(ALL_CFLAGS)) -c $< -o $@

$(BUILD)/obj/%.cu.o: %.cu
	$(call say,NVCC,$<)
	$(Q)mkdir -p $(@D) && $(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@

define lib_rule
$(BUILD)/lib/librekv_$(1).a: $$(OBJS_$(1))
	$$(call say,AR,$$@)
	$$(Q)mkdir -p $$(@D) && rm -f $$@ && ar rcs $$@ $$^
endef
$(foreach m,$(MODULES),$(eval $(call lib_rule,$(m))))

ifeq ($(CUDA),1)
$(BUILD)/gen/cuda.map:
	$(Q)mkdir -p $(@D) && echo '{ global: rekv_cuda_module_get; local: *; };' > $@
$(CUDA_SO): $(CUDA_OBJS) $(BUILD)/lib/librekv_device.a $(BUILD)/lib/librekv_common.a $(BUILD)/gen/cuda.map
	$(call say,LD,$@)
	$(Q)mkdir -p $(@D) && $(CC) -shared -o $@ $(CUDA_OBJS) -Wl,--start-group \
		$(BUILD)/lib/librekv_device.a $(BUILD)/lib/librekv_common.a -Wl,--end-group \
		-L$(CUDA_HOME)/lib64 -lcublas -lcudart -lstdc++ -lpthread -lm \
		-Wl,-rpath,$(CUDA_HOME)/lib64 -Wl,--version-script=$(BUILD)/gen/cuda.map -Wl,-z,defs
endif

define prog_rule
$(BUILD)/bin/$(1): $(BUILD)/obj/$(patsubst %.c,%.o,$(MAIN_$(1))) $(call room_libs,$(1)) | $(CUDA_SO)
	$$(call say,LD,$$@)
	$$(Q)mkdir -p $$(@D) && $$(CC) -o $$@ $$< -Wl,--start-group $(call room_libs,$(1)) -Wl,--end-group $(call room_ldlibs,$(1))
endef
$(foreach p,$(PROGRAMS),$(eval $(call prog_rule,$(p))))

$(BUILD)/tests/%: $(BUILD)/obj/tests/%.o $(TEST_SUPPORT_OBJS) $(call room_libs,tests) | $(CUDA_SO)
	$(call say,LD,$@)
	$(Q)mkdir -p $(@D) && $(CC) -o $@ $< $(TEST_SUPPORT_OBJS) -Wl,--start-group $(call room_libs,tests) -Wl,--end-group $(CHECK_LIBS) $(call room_ldlibs,tests)
# test_journal_fsync's LD_PRELOAD shim (logs the journal's writes and syncs and the replies sent)
$(BUILD)/tests/libfsync_shim.so: tests/shim/fsync_shim.c
	$(call say,LD,$@)
	$(Q)mkdir -p $(@D) && $(CC) -std=gnu11 $(WARN) $(CFLAGS) -fPIC -shared -o $@ $< -ldl
$(BUILD)/tests/test_journal_fsync: | $(BUILD)/tests/libfsync_shim.so

# Sanitizer build of the parsers, run over a corpus of mutated inputs (part of `make test`).
ASAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
ASAN_SRCS := $(call lib_srcs,common) $(call lib_srcs,loader)
ASAN_OBJS := $(patsubst %.c,$(BUILD)/asan/%.o,$(ASAN_SRCS) tests/fuzz_parsers.c)
$(BUILD)/asan/%.o: %.c
	$(call say,CC-ASAN,$<)
	$(Q)mkdir -p $(@D) && $(CC) $(ALL_CFLAGS) -O1 $(ASAN_FLAGS) -c $< -o $@
$(BUILD)/asan/fuzz_parsers: $(ASAN_OBJS)
	$(call say,LD,$@)
	$(Q)$(CC) $(ASAN_FLAGS) -o $@ $^ $(LDLIBS)

fuzz: $(if $(wildcard tests/fuzz_parsers.c),$(BUILD)/asan/fuzz_parsers)
	$(if $(wildcard tests/fuzz_parsers.c),$(Q)tests/run_fuzz.sh $(BUILD)/asan/fuzz_parsers)

# Tests. `make test` runs them all — what README and CI run: the parser fuzzer (make fuzz), the
# rooms' arrows (tests/check_rooms.sh, and that the check catches a crossing), every sh block of
# the documentation (tests/check_docs.sh, and that the check catches a broken one), every test
# program but its virtual-machine cases, then those. tests/run_tests.sh prints a line as each program
# starts ([N/M]) and as each case ends, and the slowest programs at the end.
# - `make test-vm`: only the virtual-machine cases (Check tag "vm": each boots a machine under
#   qemu with tests/vm.sh, minutes each without KVM — about half of `make test`'s time): the
#   cases of every tests/test_*.c that calls tcase_set_tags(..., "vm").
# - `make test-quick`: the rooms and every program without its virtual-machine cases and without
#   the fuzzer, for a developer's loop; `make test` before a commit.
# One program alone: build/tests/test_X (CK_RUN_SUITE / CK_RUN_CASE narrow it; CK_LOG_FILE_NAME=-
# prints each case as it ends).
VM_TEST_BINS := $(patsubst tests/%.c,$(BUILD)/tests/%,$(shell grep -l 'tcase_set_tags([^,]*, *"vm")' $(TEST_SRCS)))
test_rooms = $(Q)echo "== rooms (tests/check_rooms.sh)" && tests/check_rooms.sh && tests/check_rooms.sh --self-test
test_docs = $(Q)echo "== the documentation's commands (tests/check_docs.sh)" && tests/check_docs.sh --self-test && tests/check_docs.sh
run_quick = CK_EXCLUDE_TAGS=vm tests/run_tests.sh $(TEST_BINS)
run_vm = CK_INCLUDE_TAGS=vm tests/run_tests.sh $(VM_TEST_BINS)

test: $(BINS) $(CUDA_SO) $(TEST_BINS) fuzz
	$(test_rooms)
	$(test_docs)
	$(Q)failed=0; $(run_quick) || failed=1; \
	echo "== the virtual-machine cases (make test-vm)"; $(run_vm) || failed=1; exit $$failed

test-quick: $(BINS) $(CUDA_SO) $(TEST_BINS)
	$(test_rooms)
	$(Q)$(run_quick)

test-vm: $(BINS) $(CUDA_SO) $(VM_TEST_BINS)
	$(Q)$(run_vm)

# Installs the programs and the cuda backend's object (BINDIR/../lib/rekv), the systemd units
# (ExecStart pointed at BINDIR), the rekv system user (sysusers.d) and the environment file's
# example; DESTDIR stages it (packaging, tests).
PREFIX ?= /usr/local
BINDIR ?= $(PREFIX)/bin
SYSCONFDIR ?= /etc
UNITDIR ?= $(PREFIX)/lib/systemd/system
SYSUSERSDIR ?= $(PREFIX)/lib/sysusers.d
# the cuda backend's object, where the programs look for it: beside BINDIR (backend_cuda.h)
CUDALIBDIR := $(patsubst %/,%,$(dir $(patsubst %/,%,$(BINDIR))))/lib/rekv
UNITS := $(wildcard deploy/systemd/*.service)
install: $(BINS) $(CUDA_SO)
	$(Q)install -d '$(DESTDIR)$(BINDIR)' '$(DESTDIR)$(UNITDIR)' '$(DESTDIR)$(SYSUSERSDIR)' \
		'$(DESTDIR)$(SYSCONFDIR)/rekv'
	$(Q)install -m 0755 $(BINS) '$(DESTDIR)$(BINDIR)/'
	$(if $(CUDA_SO),$(Q)install -d '$(DESTDIR)$(CUDALIBDIR)' && \
		install -m 0644 $(CUDA_SO) '$(DESTDIR)$(CUDALIBDIR)/')
	$(Q)for u in $(UNITS); do \
		sed 's|/usr/bin/|$(BINDIR)/|g' $$u > '$(DESTDIR)$(UNITDIR)'/$$(basename $$u).tmp && \
		chmod 0644 '$(DESTDIR)$(UNITDIR)'/$$(basename $$u).tmp && \
		mv '$(DESTDIR)$(UNITDIR)'/$$(basename $$u).tmp '$(DESTDIR)$(UNITDIR)'/$$(basename $$u) \
		|| exit 1; done
	$(Q)install -m 0644 deploy/sysusers.d/rekv.conf '$(DESTDIR)$(SYSUSERSDIR)/rekv.conf'
	$(Q)install -m 0644 deploy/rekv.env '$(DESTDIR)$(SYSCONFDIR)/rekv/rekv.env.example'
	$(call say,INSTALL,$(DESTDIR)$(PREFIX))

format:
	clang-format -i $$(git ls-files '*.c' '*.h' '*.cu')

clean:
	rm -rf $(BUILD)

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
