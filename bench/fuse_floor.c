/* The floor of any FUSE file system on the machine the bench runs on: a file system in C
 * (libfuse 3, low-level API, one thread) that keeps every file in memory and does nothing
 * else. The bench saves, lists and reads back its many-file step on it beside tierfs and
 * tmpfs: whatever a FUSE daemon does, a file costs it at least these round trips through
 * the kernel, so a ratio to tmpfs below this one's is out of reach for any of them.
 *
 * With --as-tierfs it also does the two things tierfs's contract asks of any daemon, and
 * nothing more: it answers GETXATTR (ENODATA: `getfattr user.tierfs.*` needs the kernel to
 * keep asking, where a daemon without it answers ENOSYS once and is never asked again), and
 * the kernel checks permissions (`default_permissions`: a job runs as another user). Each
 * costs round trips: `ls -l` asks every file for its security.selinux attribute, and the
 * kernel asks for a directory's attributes before each CREATE in it.
 *
 * Built and mounted by bench/fuse_floor.py: fuse_floor [--as-tierfs] MOUNTPOINT (until
 * unmounted).
 * Files and directories are kept in one table by (parent, name); nothing is ever removed
 * (the bench mounts a fresh one for each run). */
#define FUSE_USE_VERSION 34
#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#define MAX_NODES (1 << 20)
#define BUCKETS (1 << 21) /* open addressing, kept at most half full */

struct node {
  fuse_ino_t parent;
  char *name;
  mode_t mode;
  char *data;
  size_t size, capacity;
};

static struct node nodes[MAX_NODES];
static fuse_ino_t next_ino = FUSE_ROOT_ID + 1;
static fuse_ino_t buckets[BUCKETS]; /* (parent, name) -> inode, 0 where empty */

static unsigned bucket_of(fuse_ino_t parent, const char *name) {
  unsigned h = (unsigned)parent * 2654435761u;
  while (*name) h = h * 31 + (unsigned char)*name++;
  return h & (BUCKETS - 1);
}

static fuse_ino_t find(fuse_ino_t parent, const char *name) {
  for (unsigned b = bucket_of(parent, name);; b = (b + 1) & (BUCKETS - 1)) {
    fuse_ino_t ino = buckets[b];
    if (!ino) return 0;
    if (nodes[ino].parent == parent && !strcmp(nodes[ino].name, name)) return ino;
  }
}

static fuse_ino_t add(fuse_ino_t parent, const char *name, mode_t mode) {
  if (next_ino >= MAX_NODES) return 0;
  fuse_ino_t ino = next_ino++;
  nodes[ino] = (struct node){.parent = parent, .name = strdup(name), .mode = mode};
  unsigned b = bucket_of(parent, name);
  while (buckets[b]) b = (b + 1) & (BUCKETS - 1);
  buckets[b] = ino;
  return ino;
}

static void fill_stat(fuse_ino_t ino, struct stat *st) {
  memset(st, 0, sizeof *st);
  st->st_ino = ino;
  st->st_mode = nodes[ino].mode;
  st->st_nlink = 1;
  st->st_size = (off_t)nodes[ino].size;
  clock_gettime(CLOCK_REALTIME, &st->st_mtim);
  st->st_atim = st->st_ctim = st->st_mtim;
}

static void fill_entry(fuse_ino_t ino, struct fuse_entry_param *entry) {
  memset(entry, 0, sizeof *entry);
  entry->ino = ino;
  entry->attr_timeout = entry->entry_timeout = 1.0; /* as tierfs's */
  fill_stat(ino, &entry->attr);
}

static void reply_entry(fuse_req_t req, fuse_ino_t ino) {
  struct fuse_entry_param entry;
  if (!ino) {
    fuse_reply_err(req, ENOSPC);
    return;
  }
  fill_entry(ino, &entry);
  fuse_reply_entry(req, &entry);
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
  fuse_ino_t ino = find(parent, name);
  if (ino) reply_entry(req, ino);
  else fuse_reply_err(req, ENOENT);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
  struct stat st;
  (void)fi;
  fill_stat(ino, &st);
  fuse_reply_attr(req, &st, 1.0);
}

static void op_setattr(fuse_req_t req, fuse_ino_t ino, struct stat *attr, int to_set,
                       struct fuse_file_info *fi) {
  if ((to_set & FUSE_SET_ATTR_SIZE) && (size_t)attr->st_size < nodes[ino].size)
    nodes[ino].size = (size_t)attr->st_size;
  op_getattr(req, ino, fi);
}

static void op_mkdir(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode) {
  reply_entry(req, add(parent, name, S_IFDIR | (mode & 07777)));
}

static void op_create(fuse_req_t req, fuse_ino_t parent, const char *name, mode_t mode,
                      struct fuse_file_info *fi) {
  struct fuse_entry_param entry;
  fuse_ino_t ino = find(parent, name);
  if (!ino) ino = add(parent, name, S_IFREG | (mode & 07777));
  if (!ino) {
    fuse_reply_err(req, ENOSPC);
    return;
  }
  fi->fh = ino;
  fill_entry(ino, &entry);
  fuse_reply_create(req, &entry, fi);
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
  if (fi->flags & O_TRUNC) nodes[ino].size = 0; /* libfuse asks for atomic O_TRUNC */
  fi->fh = ino;
  fuse_reply_open(req, fi);
}

static void op_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
  fi->fh = ino;
  fuse_reply_open(req, fi);
}

static void op_write(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t size, off_t off,
                     struct fuse_file_info *fi) {
  struct node *node = &nodes[ino];
  size_t end = (size_t)off + size;
  (void)fi;
  if (end > node->capacity) {
    char *grown = realloc(node->data, end * 2);
    if (!grown) {
      fuse_reply_err(req, ENOMEM);
      return;
    }
    node->data = grown;
    node->capacity = end * 2;
  }
  memcpy(node->data + off, buf, size);
  if (end > node->size) node->size = end;
  fuse_reply_write(req, size);
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                    struct fuse_file_info *fi) {
  struct node *node = &nodes[ino];
  (void)fi;
  if ((size_t)off >= node->size) {
    fuse_reply_buf(req, NULL, 0);
    return;
  }
  if ((size_t)off + size > node->size) size = node->size - (size_t)off;
  fuse_reply_buf(req, node->data + off, size);
}

static void op_getxattr(fuse_req_t req, fuse_ino_t ino, const char *name, size_t size) {
  (void)ino;
  (void)name;
  (void)size;
  fuse_reply_err(req, ENODATA);
}

static void op_done(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
  (void)ino;
  (void)fi;
  fuse_reply_err(req, 0); /* flush, release, releasedir: nothing to do */
}

/* Directory offsets are inode numbers: entry `ino` is followed by those after it. */
static void list(fuse_req_t req, fuse_ino_t dir, size_t size, off_t off, int plus) {
  char *buf = malloc(size);
  size_t used = 0;
  if (!buf) {
    fuse_reply_err(req, ENOMEM);
    return;
  }
  for (fuse_ino_t ino = (fuse_ino_t)off + 1; ino < next_ino; ino++) {
    size_t length;
    if (nodes[ino].parent != dir || ino == FUSE_ROOT_ID) continue;
    if (plus) {
      struct fuse_entry_param entry;
      fill_entry(ino, &entry);
      length = fuse_add_direntry_plus(req, buf + used, size - used, nodes[ino].name, &entry,
                                      (off_t)ino);
    } else {
      struct stat st;
      fill_stat(ino, &st);
      length = fuse_add_direntry(req, buf + used, size - used, nodes[ino].name, &st,
                                 (off_t)ino);
    }
    if (length > size - used) break; /* the page is full: the next call starts here */
    used += length;
  }
  fuse_reply_buf(req, buf, used);
  free(buf);
}

static void op_readdir(fuse_req_t req, fuse_ino_t dir, size_t size, off_t off,
                       struct fuse_file_info *fi) {
  (void)fi;
  list(req, dir, size, off, 0);
}

static void op_readdirplus(fuse_req_t req, fuse_ino_t dir, size_t size, off_t off,
                           struct fuse_file_info *fi) {
  (void)fi;
  list(req, dir, size, off, 1);
}

static const struct fuse_lowlevel_ops operations = {
    .lookup = op_lookup,     .getattr = op_getattr, .setattr = op_setattr,
    .mkdir = op_mkdir,       .create = op_create,   .open = op_open,
    .write = op_write,       .read = op_read,       .flush = op_done,
    .release = op_done,      .opendir = op_opendir, .readdir = op_readdir,
    .readdirplus = op_readdirplus, .releasedir = op_done,
};

int main(int argc, char *argv[]) {
  struct fuse_args args = FUSE_ARGS_INIT(0, NULL);
  struct fuse_session *session;
  struct fuse_lowlevel_ops ops = operations;
  int failed;
  int as_tierfs = argc == 3 && strcmp(argv[1], "--as-tierfs") == 0;
  if (argc != 2 && !as_tierfs) return 2;
  nodes[FUSE_ROOT_ID] = (struct node){.name = "", .mode = S_IFDIR | 0755};
  fuse_opt_add_arg(&args, argv[0]);
  if (as_tierfs) {
    ops.getxattr = op_getxattr;
    fuse_opt_add_arg(&args, "-odefault_permissions");
  }
  session = fuse_session_new(&args, &ops, sizeof ops, NULL);
  if (!session || fuse_session_mount(session, argv[argc - 1])) return 1;
  failed = fuse_session_loop(session);
  fuse_session_unmount(session);
  fuse_session_destroy(session);
  return failed ? 1 : 0;
}
