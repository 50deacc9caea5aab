package cli

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/BurntSushi/toml"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/ucxtransport"
	"github.com/cudaipc/cudaipc/internal/bytesize"
	"github.com/cudaipc/cudaipc/store"
)

// daemonConfig is every setting of 'cudaipc serve': the defaults, then the
// TOML file of --config, then the flags (docs/configuration.md). A key of
// the file is the setting's flag name; settings without a flag of the
// default help live in the file, and tuning under the experimental- prefix,
// which is also a hidden --experimental-NAME flag. printConfig writes the
// fields in this order, each after its help.
type daemonConfig struct {
	Backend  string        `toml:"backend" help:"Memory backend: auto (cuda where the CUDA driver sees a GPU, else host), cuda or host."`
	GPUShare string        `toml:"gpu-share" help:"How GPU arenas reach clients: ipc (CUDA IPC, clients in the daemon's PID namespace) or fd (VMM memory sent as file descriptors, clients in other containers too)."`
	Capacity bytesize.Size `toml:"capacity" help:"Bytes of memory per device (host, and each GPU) the store may use."`
	AllowUID []uint32      `toml:"allow-uid" help:"Uids admitted besides the daemon's own and root."`
	AllowGID []uint32      `toml:"allow-gid" help:"Gids whose members are admitted."`

	Cluster       string `toml:"cluster" help:"etcd of the cluster to join: etcd://HOST:PORT[,HOST:PORT...] (etcds:// for TLS); empty: run alone."`
	Node          string `toml:"node" help:"This daemon's name in the cluster (empty: the host name)."`
	ClusterSecret string `toml:"cluster-secret" help:"File holding the cluster's shared secret (at least 16 bytes, mode 0600)."`
	ClusterListen string `toml:"cluster-listen" help:"Address the cluster control channel listens on (empty: the address it advertises; :PORT for every interface)."`
	ClusterAdv    string `toml:"cluster-advertise" help:"HOST:PORT other daemons reach the control channel at (empty: this host's address towards etcd)."`
	EtcdCA        string `toml:"etcd-ca" help:"CA certificate that signed etcd's (turns on TLS)."`
	EtcdCert      string `toml:"etcd-cert" help:"Client certificate for etcd."`
	EtcdKey       string `toml:"etcd-key" help:"Client key for etcd."`
	ClusterPrefix string `toml:"cluster-prefix" help:"etcd key prefix of the cluster; clusters sharing an etcd use different ones."`
	UCXLib        string `toml:"ucx-lib" help:"libucp.so.0 to load instead of the system's (empty: the system's), e.g. a UCX built with CUDA."`

	Metrics          string        `toml:"metrics" help:"Serve Prometheus metrics on this address at /metrics; a bare port (9464 or :9464) binds loopback only; empty: none."`
	Evict            bool          `toml:"evict" help:"Evict sealed objects without leases to make room; false: creates fail with 'store full' instead."`
	KeepVersions     int           `toml:"keep-versions" help:"Newest versions of each versioned name kept without leases (a name may set its own)."`
	Quota            bytesize.Size `toml:"quota" help:"Bytes each uid's objects may take on each device; a uid's creates evict only its own objects (0: the capacity divided by the uids admitted)."`
	MaxConns         int           `toml:"max-conns" help:"Most connections served at once (0: 4096, or half the descriptor limit if lower)."`
	MaxConnsPerUID   int           `toml:"max-conns-per-uid" help:"Most connections of one uid, root's included."`
	MaxObjects       int           `toml:"max-objects" help:"Most objects (drafts and sealed) one connection may create."`
	MaxObjectsPerUID int           `toml:"max-objects-per-uid" help:"Most objects of one uid over all its connections, deleted ones still leased included."`
	MaxLeases        int           `toml:"max-leases" help:"Most leases one connection may hold at once."`
	MaxFDs           int           `toml:"max-fds" help:"Most descriptors the daemon keeps for objects (0: half of what the descriptor limit leaves beside max-conns)."`
	MaxFDsPerUID     int           `toml:"max-fds-per-uid" help:"Most descriptors the daemon keeps for one uid's objects (0: a fair share of max-fds among the uids admitted)."`

	Spin              time.Duration `toml:"experimental-spin" help:"How long a connection polls for the client's next request before sleeping, at up to this much CPU per request (0: never poll)."`
	KeepArenas        keptBytes     `toml:"experimental-keep-arenas" help:"Bytes of empty GPU arenas each GPU keeps for their owner's next objects: capacity, or a size (0: give them back at once)."`
	CPUProfile        string        `toml:"experimental-cpu-profile" help:"Write a CPU profile of the daemon's whole run to this file (empty: none)."`
	ClusterStreams    int           `toml:"experimental-cluster-streams" help:"Reads a pull keeps in flight from one holder, 0 to 64 (0: four a lane, at least 8)."`
	ClusterLanes      int           `toml:"experimental-cluster-lanes" help:"UCX workers serving and pulling, each with its own progress thread and connection, 0 to 16 (0 and 1: one)."`
	ClusterRead       string        `toml:"experimental-cluster-read" help:"How this daemon reads other daemons' memory: fetch (the holder sends the bytes) or get (one-sided UCX GETs, which the daemon then answers from anyone reaching its UCX port)."`
	ClusterChecksums  string        `toml:"experimental-cluster-checksums" help:"Where GPU objects' chunk checksums are computed: auto (on the GPU where the driver runs the daemon's kernel, else the host) or host."`
	ClusterChunk      bytesize.Size `toml:"experimental-cluster-chunk" help:"Chunk of the objects this daemon publishes: a power of two from 64KiB to 1GiB (0: 4MiB, larger for objects of many chunks)."`
	ClusterGPUPublish string        `toml:"experimental-cluster-gpu-publish" help:"When a GPU object's record goes out: early (once its GPU has the checksums) or staged (after its copy to host memory)."`
}

// defaultConfig is what serve runs with when neither a file nor a flag
// says otherwise.
func defaultConfig() daemonConfig {
	return daemonConfig{
		Backend:           "auto",
		GPUShare:          store.GPUShareIPC,
		Capacity:          store.DefaultCapacity,
		AllowUID:          []uint32{},
		AllowGID:          []uint32{},
		ClusterPrefix:     "/cudaipc/v1/",
		Evict:             true,
		KeepVersions:      store.DefaultKeepVersions,
		MaxConnsPerUID:    store.DefaultMaxConnsPerUID,
		MaxObjects:        store.DefaultMaxObjectsPerClient,
		MaxObjectsPerUID:  store.DefaultMaxObjectsPerUID,
		MaxLeases:         store.DefaultMaxLeasesPerClient,
		Spin:              store.DefaultSpin,
		KeepArenas:        keepCapacity,
		ClusterLanes:      8,
		ClusterRead:       string(ucxtransport.ReadFetch),
		ClusterChecksums:  "auto",
		ClusterGPUPublish: "early",
	}
}

// ErrConfig is what a config file or a setting that cannot be used wraps.
var ErrConfig = errors.New("bad configuration")

// loadConfigFile reads the TOML file path over cfg. A key that names no
// setting is an error, so that a misspelt one is not silently ignored.
func loadConfigFile(path string, cfg *daemonConfig) error {
	md, err := toml.DecodeFile(path, cfg)
	if err != nil {
		return fmt.Errorf("%w: %s: %s", ErrConfig, path, strings.TrimPrefix(err.Error(), "toml: "))
	}
	if u := md.Undecoded(); len(u) > 0 {
		return fmt.Errorf("%w: %s: unknown setting %q ('cudaipc serve --print-config' lists them)", ErrConfig, path, u[0].String())
	}
	return nil
}

// validate checks what the types do not, naming the setting.
func (c *daemonConfig) validate() error {
	bad := func(key string, v any, want string) error {
		return fmt.Errorf("%w: %s = %v: want %s", ErrConfig, key, v, want)
	}
	oneOf := func(key, v string, want ...string) error {
		if slices.Contains(want, v) {
			return nil
		}
		return bad(key, fmt.Sprintf("%q", v), strings.Join(want, " or "))
	}
	for _, err := range []error{
		oneOf("backend", c.Backend, "auto", "cuda", "host"),
		oneOf("gpu-share", c.GPUShare, store.GPUShareIPC, store.GPUShareFD),
		oneOf("experimental-cluster-read", c.ClusterRead, string(ucxtransport.ReadFetch), string(ucxtransport.ReadGet)),
		oneOf("experimental-cluster-checksums", c.ClusterChecksums, "auto", "host"),
		oneOf("experimental-cluster-gpu-publish", c.ClusterGPUPublish, "early", "staged"),
	} {
		if err != nil {
			return err
		}
	}
	for _, s := range []struct {
		key string
		n   int64
	}{
		{"capacity", int64(c.Capacity)}, {"quota", int64(c.Quota)}, {"keep-versions", int64(c.KeepVersions)},
		{"max-conns", int64(c.MaxConns)}, {"max-conns-per-uid", int64(c.MaxConnsPerUID)},
		{"max-objects", int64(c.MaxObjects)}, {"max-objects-per-uid", int64(c.MaxObjectsPerUID)},
		{"max-leases", int64(c.MaxLeases)}, {"max-fds", int64(c.MaxFDs)}, {"max-fds-per-uid", int64(c.MaxFDsPerUID)},
		{"experimental-spin", int64(c.Spin)},
	} {
		if s.n < 0 {
			return bad(s.key, s.n, "0 or more")
		}
	}
	if c.ClusterStreams < 0 || c.ClusterStreams > 64 {
		return bad("experimental-cluster-streams", c.ClusterStreams, "0 (the default) to 64")
	}
	if c.ClusterLanes < 0 || c.ClusterLanes > ucxtransport.MaxLanes {
		return bad("experimental-cluster-lanes", c.ClusterLanes, fmt.Sprintf("0 (one) to %d", ucxtransport.MaxLanes))
	}
	if n := int64(c.ClusterChunk); n != 0 && !cluster.ValidChunkSize(n) {
		return bad("experimental-cluster-chunk", c.ClusterChunk, "0 (the default) or a power of two from 64KiB to 1GiB")
	}
	return nil
}

// printConfig writes cfg as a config file that loadConfigFile reads back
// to cfg: every setting, after its help as a comment.
func printConfig(w io.Writer, cfg daemonConfig) error {
	var b bytes.Buffer
	b.WriteString("# cudaipc serve --config FILE: every setting, with the value it has now (docs/configuration.md).\n")
	v := reflect.ValueOf(cfg)
	for i := range v.NumField() {
		f := v.Type().Field(i)
		fmt.Fprintf(&b, "\n# %s\n", f.Tag.Get("help"))
		if err := toml.NewEncoder(&b).Encode(map[string]any{f.Tag.Get("toml"): v.Field(i).Interface()}); err != nil {
			return err
		}
	}
	_, err := w.Write(b.Bytes())
	return err
}

// keptBytes is experimental-keep-arenas: keepCapacity, or a byte count.
type keptBytes int64

// keepCapacity keeps empty arenas up to the capacity.
const keepCapacity keptBytes = -1

// MarshalText prints "capacity" or the byte count.
func (k keptBytes) MarshalText() ([]byte, error) {
	if k == keepCapacity {
		return []byte("capacity"), nil
	}
	return bytesize.Size(k).MarshalText()
}

// UnmarshalText reads "capacity" or a byte count.
func (k *keptBytes) UnmarshalText(text []byte) error {
	if string(text) == "capacity" {
		*k = keepCapacity
		return nil
	}
	n, err := bytesize.Parse(string(text))
	if err != nil {
		return fmt.Errorf("%w, or capacity", err)
	}
	*k = keptBytes(n)
	return nil
}

// storeKeepArenas is store.Config.KeepArenas for k (0: the capacity;
// negative: none).
func storeKeepArenas(k keptBytes) int64 {
	switch k {
	case keepCapacity:
		return 0
	case 0:
		return -1
	}
	return int64(k)
}

// storeSpin is store.Config.Spin for experimental-spin (0: never poll),
// where 0 means the default and negative never.
func storeSpin(d time.Duration) time.Duration {
	if d <= 0 {
		return -1
	}
	return d
}

// storeConfig is the store's part of cfg.
func (c *daemonConfig) storeConfig() store.Config {
	return store.Config{
		Backend:             c.Backend,
		GPUShare:            c.GPUShare,
		Capacity:            int64(c.Capacity),
		NoEvict:             !c.Evict,
		KeepVersions:        c.KeepVersions,
		AllowUIDs:           c.AllowUID,
		AllowGIDs:           c.AllowGID,
		MaxObjectsPerClient: c.MaxObjects,
		MaxLeasesPerClient:  c.MaxLeases,
		MaxConns:            c.MaxConns,
		Quota:               int64(c.Quota),
		KeepArenas:          storeKeepArenas(c.KeepArenas),
		MaxConnsPerUID:      c.MaxConnsPerUID,
		MaxObjectsPerUID:    c.MaxObjectsPerUID,
		MaxFDs:              c.MaxFDs,
		MaxFDsPerUID:        c.MaxFDsPerUID,
		Spin:                storeSpin(c.Spin),
	}
}
