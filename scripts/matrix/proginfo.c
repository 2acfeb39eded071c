// SPDX-License-Identifier: MIT OR Apache-2.0
/*
 * proginfo: print one line per pinned BPF program with the numbers the
 * kernel-version matrix reports, using raw bpf(2) syscalls only (no libbpf),
 * so that a static build runs in the matrix's initramfs and on any kernel.
 *
 *   proginfo PIN...   ->  name<TAB>type<TAB>xlated_insns<TAB>jited_bytes<TAB>verified_insns
 *
 * verified_insns (instructions processed by the verifier) exists from Linux
 * 5.16; Debian 12's bpftool 7.1 does not print it, hence this tool. On an
 * older kernel the field reads 0.
 */
#include <errno.h>
#include <linux/bpf.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static int sys_bpf(int cmd, union bpf_attr *attr)
{
	return (int)syscall(__NR_bpf, cmd, attr, sizeof(*attr));
}

int main(int argc, char **argv)
{
	int rc = 0;

	for (int i = 1; i < argc; i++) {
		union bpf_attr attr;
		struct bpf_prog_info info;
		int fd;

		memset(&attr, 0, sizeof(attr));
		attr.pathname = (uint64_t)(uintptr_t)argv[i];
		fd = sys_bpf(BPF_OBJ_GET, &attr);
		if (fd < 0) {
			fprintf(stderr, "proginfo: %s: BPF_OBJ_GET: %s\n", argv[i], strerror(errno));
			rc = 1;
			continue;
		}
		memset(&info, 0, sizeof(info));
		memset(&attr, 0, sizeof(attr));
		attr.info.bpf_fd = (uint32_t)fd;
		attr.info.info_len = sizeof(info);
		attr.info.info = (uint64_t)(uintptr_t)&info;
		if (sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &attr) < 0) {
			fprintf(stderr, "proginfo: %s: BPF_OBJ_GET_INFO_BY_FD: %s\n", argv[i], strerror(errno));
			rc = 1;
			close(fd);
			continue;
		}
		printf("%s\t%u\t%u\t%u\t%u\n", info.name, info.type, info.xlated_prog_len / 8,
		       info.jited_prog_len, info.verified_insns);
		close(fd);
	}
	return rc;
}
