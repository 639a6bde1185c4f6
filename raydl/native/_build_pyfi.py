"""cffi builder for raydl.native.pyfi._pyfi: our libfabric bindings (API mode).

Most of libfabric's API (fi_domain, fi_endpoint, fi_read, fi_cq_read, fi_mr_reg,
fi_close, ...) is `static inline` in the headers, dispatching through the
objects' ops tables; only about sixteen functions are exported symbols. In
cffi's API mode every declared function is called from compiled C, so the
inline ones are declared below exactly like the exported ones, and the
compiler resolves both. A few small C helpers sit in `_HELPERS` where a call
needs a struct built on the stack (fi_writemsg) or a poll loop that should run
without the GIL and without a Python round trip per poll.

Needs libfabric's headers (Debian: libfabric-dev) at build time and
libfabric.so at run time. setup.py builds it at install time and skips it when
the headers are missing; by hand: `python -m raydl.native._build_pyfi`.
Structs are declared partially (`...;`) so the compiler fills in the layout of
the installed libfabric.
"""

from cffi import FFI

_CDEF = """
typedef uint64_t fi_addr_t;

struct fid { size_t fclass; void *context; ...; };
typedef struct fid *fid_t;
struct fid_fabric { struct fid fid; ...; };
struct fid_domain { struct fid fid; ...; };
struct fid_ep { struct fid fid; ...; };
struct fid_cq { struct fid fid; ...; };
struct fid_av { struct fid fid; ...; };
struct fid_mr { struct fid fid; ...; };

enum fi_ep_type { FI_EP_UNSPEC, FI_EP_MSG, FI_EP_DGRAM, FI_EP_RDM, ... };
enum fi_progress { FI_PROGRESS_UNSPEC, FI_PROGRESS_AUTO, FI_PROGRESS_MANUAL, ... };
enum fi_threading { FI_THREAD_UNSPEC, FI_THREAD_SAFE, FI_THREAD_FID, FI_THREAD_DOMAIN,
                    FI_THREAD_COMPLETION, FI_THREAD_ENDPOINT, ... };
enum fi_resource_mgmt { FI_RM_UNSPEC, FI_RM_DISABLED, FI_RM_ENABLED, ... };
enum fi_av_type { FI_AV_UNSPEC, FI_AV_MAP, FI_AV_TABLE, ... };
enum fi_cq_format { FI_CQ_FORMAT_UNSPEC, FI_CQ_FORMAT_CONTEXT, FI_CQ_FORMAT_MSG,
                    FI_CQ_FORMAT_DATA, FI_CQ_FORMAT_TAGGED, ... };
enum fi_wait_obj { FI_WAIT_NONE, FI_WAIT_UNSPEC, FI_WAIT_SET, FI_WAIT_FD, ... };

struct fi_tx_attr { uint64_t caps; uint64_t mode; uint64_t op_flags; uint64_t msg_order;
                    size_t inject_size; size_t size; size_t iov_limit; size_t rma_iov_limit; ...; };
struct fi_rx_attr { uint64_t caps; uint64_t mode; uint64_t op_flags; size_t size; ...; };
struct fi_ep_attr { enum fi_ep_type type; uint32_t protocol; size_t max_msg_size; ...; };
struct fi_domain_attr { char *name; enum fi_threading threading;
                        enum fi_progress control_progress; enum fi_progress data_progress;
                        enum fi_resource_mgmt resource_mgmt; enum fi_av_type av_type;
                        int mr_mode; size_t mr_key_size; size_t mr_iov_limit; size_t mr_cnt; ...; };
struct fi_fabric_attr { char *name; char *prov_name; uint32_t prov_version;
                        uint32_t api_version; ...; };
struct fi_info { struct fi_info *next; uint64_t caps; uint64_t mode; uint32_t addr_format;
                 size_t src_addrlen; size_t dest_addrlen; void *src_addr; void *dest_addr;
                 struct fi_tx_attr *tx_attr; struct fi_rx_attr *rx_attr;
                 struct fi_ep_attr *ep_attr; struct fi_domain_attr *domain_attr;
                 struct fi_fabric_attr *fabric_attr; ...; };

struct fi_cq_attr { size_t size; uint64_t flags; enum fi_cq_format format;
                    enum fi_wait_obj wait_obj; ...; };
struct fi_av_attr { enum fi_av_type type; size_t count; uint64_t flags; ...; };
struct fi_cq_entry { void *op_context; };
struct fi_cq_err_entry { void *op_context; uint64_t flags; size_t len; int err;
                         int prov_errno; void *err_data; size_t err_data_size; ...; };
struct fi_context2 { ...; };

/* Exported symbols. */
uint32_t fi_version(void);
int fi_getinfo(uint32_t version, const char *node, const char *service,
               uint64_t flags, const struct fi_info *hints, struct fi_info **info);
void fi_freeinfo(struct fi_info *info);
struct fi_info *fi_dupinfo(const struct fi_info *info);
int fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context);
const char *fi_strerror(int errnum);

/* Static inline in the headers; compiled as calls through the ops tables. */
struct fi_info *fi_allocinfo(void);
int fi_close(struct fid *fid);
int fi_domain(struct fid_fabric *fabric, struct fi_info *info,
              struct fid_domain **domain, void *context);
int fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr,
               struct fid_cq **cq, void *context);
int fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr,
               struct fid_av **av, void *context);
int fi_endpoint(struct fid_domain *domain, struct fi_info *info,
                struct fid_ep **ep, void *context);
int fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int fi_enable(struct fid_ep *ep);
int fi_getname(fid_t fid, void *addr, size_t *addrlen);
int fi_av_insert(struct fid_av *av, const void *addr, size_t count,
                 fi_addr_t *fi_addr, uint64_t flags, void *context);
int fi_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count, uint64_t flags);
int fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access,
              uint64_t offset, uint64_t requested_key, uint64_t flags,
              struct fid_mr **mr, void *context);
int fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags);
int fi_mr_enable(struct fid_mr *mr);
void *fi_mr_desc(struct fid_mr *mr);
uint64_t fi_mr_key(struct fid_mr *mr);
ssize_t fi_read(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src_addr,
                uint64_t addr, uint64_t key, void *context);
ssize_t fi_write(struct fid_ep *ep, const void *buf, size_t len, void *desc,
                 fi_addr_t dest_addr, uint64_t addr, uint64_t key, void *context);
ssize_t fi_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t fi_cq_sread(struct fid_cq *cq, void *buf, size_t count, const void *cond, int timeout);
int fi_cq_signal(struct fid_cq *cq);
int fi_control(struct fid *fid, int command, void *arg);
ssize_t fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags);
const char *fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data,
                           char *buf, size_t len);

/* Helpers (see _HELPERS). */
uint32_t pyfi_version(uint32_t major, uint32_t minor);
int pyfi_set_prov_name(struct fi_info *hints, const char *name);
ssize_t pyfi_write_delivery(struct fid_ep *ep, const void *buf, size_t len, void *desc,
                            fi_addr_t dest, uint64_t addr, uint64_t key, void *context,
                            uint64_t flags);
ssize_t pyfi_cq_wait(struct fid_cq *cq, struct fi_cq_entry *buf, size_t count,
                     int64_t timeout_us, int spin, int sleep_us);

#define FI_MAJOR_VERSION ...
#define FI_MINOR_VERSION ...
#define FI_MSG ...
#define FI_RMA ...
#define FI_READ ...
#define FI_WRITE ...
#define FI_RECV ...
#define FI_SEND ...
#define FI_TRANSMIT ...
#define FI_REMOTE_READ ...
#define FI_REMOTE_WRITE ...
#define FI_COMPLETION ...
#define FI_TRANSMIT_COMPLETE ...
#define FI_DELIVERY_COMPLETE ...
#define FI_HMEM ...
#define FI_SOURCE ...
#define FI_CONTEXT ...
#define FI_CONTEXT2 ...
#define FI_MSG_PREFIX ...
#define FI_RX_CQ_DATA ...
#define FI_ASYNC_IOV ...
#define FI_LOCAL_COMM ...
#define FI_REMOTE_COMM ...
#define FI_MR_LOCAL ...
#define FI_MR_RAW ...
#define FI_MR_VIRT_ADDR ...
#define FI_MR_ALLOCATED ...
#define FI_MR_PROV_KEY ...
#define FI_MR_MMU_NOTIFY ...
#define FI_MR_RMA_EVENT ...
#define FI_MR_ENDPOINT ...
#define FI_MR_HMEM ...
#define FI_MR_COLLECTIVE ...

#define FI_GETWAIT ...
#define FI_EAGAIN ...
#define FI_EOPNOTSUPP ...
#define FI_EAVAIL ...
#define FI_ENODATA ...
#define FI_ENOSYS ...
#define FI_ENOKEY ...
#define FI_EINVAL ...
#define FI_EACCES ...
#define FI_ECANCELED ...
#define FI_ETIMEDOUT ...
#define FI_ECONNREFUSED ...
#define FI_EIO ...
#define FI_ETOOSMALL ...
#define FI_EBADFLAGS ...
#define FI_ENOMEM ...
#define FI_ECONNRESET ...
"""

_HELPERS = r"""
#include <string.h>
#include <stdlib.h>
#include <time.h>
#include <sys/uio.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>

static uint32_t pyfi_version(uint32_t major, uint32_t minor)
{
    return FI_VERSION(major, minor);
}

/* hints->fabric_attr->prov_name is freed by fi_freeinfo, so it must be malloc'd. */
static int pyfi_set_prov_name(struct fi_info *hints, const char *name)
{
    free(hints->fabric_attr->prov_name);
    hints->fabric_attr->prov_name = name ? strdup(name) : NULL;
    return (name && !hints->fabric_attr->prov_name) ? -FI_ENOMEM : 0;
}

/* fi_write with per-operation completion semantics (FI_DELIVERY_COMPLETE), so
   the completion means the target's memory holds the bytes. */
static ssize_t pyfi_write_delivery(struct fid_ep *ep, const void *buf, size_t len, void *desc,
                                   fi_addr_t dest, uint64_t addr, uint64_t key, void *context,
                                   uint64_t flags)
{
    struct iovec iov = { (void *)buf, len };
    struct fi_rma_iov rma = { addr, len, key };
    struct fi_msg_rma msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.addr = dest;
    msg.rma_iov = &rma;
    msg.rma_iov_count = 1;
    msg.context = context;
    return fi_writemsg(ep, &msg, flags);
}

static int64_t pyfi_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Poll a CQ until it returns anything but -FI_EAGAIN or timeout_us passes
   (then -FI_EAGAIN). Polls `spin` times back to back, then sleeps sleep_us
   between polls: with manual-progress providers (tcp;ofi_rxm) each poll also
   drives the transfers, and sleeping keeps a small node's cores for others.
   Runs without the GIL (cffi releases it around every call). */
static ssize_t pyfi_cq_wait(struct fid_cq *cq, struct fi_cq_entry *buf, size_t count,
                            int64_t timeout_us, int spin, int sleep_us)
{
    int64_t deadline = pyfi_now_us() + timeout_us;
    struct timespec nap = { 0, (long)sleep_us * 1000 };
    for (int i = 0;; i++) {
        ssize_t rc = fi_cq_read(cq, buf, count);
        if (rc != -FI_EAGAIN)
            return rc;
        if (pyfi_now_us() >= deadline)
            return -FI_EAGAIN;
        if (i >= spin && sleep_us > 0)
            nanosleep(&nap, NULL);
    }
}
"""

ffibuilder = FFI()
ffibuilder.cdef(_CDEF)
# Paths relative to the project root: setup.py runs the build from there.
ffibuilder.set_source(
    "raydl.native.pyfi._pyfi",
    _HELPERS,
    libraries=["fabric"],
    extra_compile_args=["-O2", "-std=gnu99"],
)

if __name__ == "__main__":
    import os
    from pathlib import Path

    os.chdir(Path(__file__).resolve().parents[2])
    ffibuilder.compile(verbose=False)
