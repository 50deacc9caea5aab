package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"runtime/pprof"
	"strconv"
	"time"

	"github.com/cudaipc/cudaipc/internal/bytesize"
	"github.com/cudaipc/cudaipc/store"
)

// serveCmd runs the daemon. Its flags are the settings an operator picks
// per machine; every setting, these included, can also come from the file
// of --config (serve_config.go), which the flags override.
type serveCmd struct {
	Config      string `help:"Read settings from this TOML file (docs/configuration.md); flags override it." placeholder:"FILE" type:"path"`
	PrintConfig bool   `name:"print-config" help:"Print the settings serve would run with (defaults, then --config, then flags) as a config file, and exit."`

	Backend  *string        `enum:"auto,cuda,host" help:"Memory backend: auto (cuda where the CUDA driver sees a GPU, else host; the default), cuda (GPU objects, named by UUID, and host ones; fails without a GPU) or host." placeholder:"auto|cuda|host"`
	GPUShare *string        `name:"gpu-share" enum:"ipc,fd" help:"How GPU arenas reach clients: ipc (the default: CUDA IPC, clients in the daemon's PID namespace only) or fd (VMM memory sent as file descriptors: clients in other containers too)." placeholder:"ipc|fd"`
	Capacity *bytesize.Size `help:"Bytes of memory per device (host, and each GPU) the store may use, e.g. 4GiB (default 1GiB)." placeholder:"BYTES"`
	AllowUID []uint32       `name:"allow-uid" help:"Also admit this uid (repeatable; the daemon's own uid and root are always admitted)." placeholder:"N"`
	AllowGID []uint32       `name:"allow-gid" help:"Also admit members of this gid (repeatable)." placeholder:"N"`

	clusterFlags      `embed:""` // serve_cluster.go
	experimentalFlags `embed:""`
	deprecatedFlags   `embed:""`
}

// experimentalFlags set the experimental- settings: tuning that may change
// or go away, hidden from the help.
type experimentalFlags struct {
	Spin              *time.Duration `name:"experimental-spin" hidden:""`
	KeepArenas        *keptBytes     `name:"experimental-keep-arenas" hidden:""`
	CPUProfile        *string        `name:"experimental-cpu-profile" hidden:"" type:"path"`
	ClusterStreams    *int           `name:"experimental-cluster-streams" hidden:""`
	ClusterLanes      *int           `name:"experimental-cluster-lanes" hidden:""`
	ClusterRead       *string        `name:"experimental-cluster-read" hidden:"" enum:"fetch,get"`
	ClusterChecksums  *string        `name:"experimental-cluster-checksums" hidden:"" enum:"auto,host"`
	ClusterChunk      *bytesize.Size `name:"experimental-cluster-chunk" hidden:""`
	ClusterGPUPublish *string        `name:"experimental-cluster-gpu-publish" hidden:"" enum:"early,staged"`
}

// deprecatedFlags are the earlier flags of settings that now live in the
// config file, still accepted, with a warning, so that unit files written
// for them keep working.
type deprecatedFlags struct {
	Metrics          *string        `name:"metrics" hidden:""`
	NoEvict          *bool          `name:"no-evict" hidden:""`
	KeepVersions     *int           `name:"keep-versions" hidden:""`
	Quota            *bytesize.Size `name:"quota" hidden:""`
	MaxConns         *int           `name:"max-conns" hidden:""`
	MaxConnsPerUID   *int           `name:"max-conns-per-uid" hidden:""`
	MaxObjects       *int           `name:"max-objects" hidden:""`
	MaxObjectsPerUID *int           `name:"max-objects-per-uid" hidden:""`
	MaxLeases        *int           `name:"max-leases" hidden:""`
	MaxFDs           *int           `name:"max-fds" hidden:""`
	MaxFDsPerUID     *int           `name:"max-fds-per-uid" hidden:""`
	ClusterPrefix    *string        `name:"cluster-prefix" hidden:""`
	UCXLib           *string        `name:"ucx-lib" hidden:""`
}

func (c *serveCmd) Help() string {
	return `Runs the object store daemon in the foreground until SIGINT or SIGTERM.

The socket is --socket, else $CUDAIPC_SOCKET, else $XDG_RUNTIME_DIR/cudaipc/store.sock,
else /run/cudaipc/store.sock for root and /tmp/cudaipc-<uid>/store.sock for others.
Only the daemon's uid and root may connect unless --allow-uid/--allow-gid admit others.
Objects are private to their creator's uid unless created shared ('cudaipc put --shared').

Limits, metrics and tuning are set in the file of --config; 'cudaipc serve --print-config'
prints every setting with its value, and docs/configuration.md describes them.`
}

// settings is the configuration serve runs with: the defaults, then the
// file of --config, then the flags given.
func (c *serveCmd) settings(g *Globals) (daemonConfig, error) {
	cfg := defaultConfig()
	if c.Config != "" {
		if err := loadConfigFile(c.Config, &cfg); err != nil {
			return cfg, err
		}
	}
	set(&cfg.Backend, c.Backend)
	set(&cfg.GPUShare, c.GPUShare)
	set(&cfg.Capacity, c.Capacity)
	if c.AllowUID != nil {
		cfg.AllowUID = c.AllowUID
	}
	if c.AllowGID != nil {
		cfg.AllowGID = c.AllowGID
	}
	c.clusterFlags.apply(&cfg)

	e := &c.experimentalFlags
	set(&cfg.Spin, e.Spin)
	set(&cfg.KeepArenas, e.KeepArenas)
	set(&cfg.CPUProfile, e.CPUProfile)
	set(&cfg.ClusterStreams, e.ClusterStreams)
	set(&cfg.ClusterLanes, e.ClusterLanes)
	set(&cfg.ClusterRead, e.ClusterRead)
	set(&cfg.ClusterChecksums, e.ClusterChecksums)
	set(&cfg.ClusterChunk, e.ClusterChunk)
	set(&cfg.ClusterGPUPublish, e.ClusterGPUPublish)

	d := &c.deprecatedFlags
	old := func(flag, key string, given bool) {
		if given {
			g.log.Warn("serve --" + flag + " is deprecated: set " + key + " in the file of --config instead")
		}
	}
	old("metrics", "metrics", set(&cfg.Metrics, d.Metrics))
	if d.NoEvict != nil {
		cfg.Evict = !*d.NoEvict
		old("no-evict", "evict = false", true)
	}
	old("keep-versions", "keep-versions", set(&cfg.KeepVersions, d.KeepVersions))
	old("quota", "quota", set(&cfg.Quota, d.Quota))
	old("max-conns", "max-conns", set(&cfg.MaxConns, d.MaxConns))
	old("max-conns-per-uid", "max-conns-per-uid", set(&cfg.MaxConnsPerUID, d.MaxConnsPerUID))
	old("max-objects", "max-objects", set(&cfg.MaxObjects, d.MaxObjects))
	old("max-objects-per-uid", "max-objects-per-uid", set(&cfg.MaxObjectsPerUID, d.MaxObjectsPerUID))
	old("max-leases", "max-leases", set(&cfg.MaxLeases, d.MaxLeases))
	old("max-fds", "max-fds", set(&cfg.MaxFDs, d.MaxFDs))
	old("max-fds-per-uid", "max-fds-per-uid", set(&cfg.MaxFDsPerUID, d.MaxFDsPerUID))
	old("cluster-prefix", "cluster-prefix", set(&cfg.ClusterPrefix, d.ClusterPrefix))
	old("ucx-lib", "ucx-lib", set(&cfg.UCXLib, d.UCXLib))
	return cfg, cfg.validate()
}

// set overrides *dst with a flag's value, if the flag was given, and
// reports whether it was.
func set[T any](dst *T, flag *T) bool {
	if flag == nil {
		return false
	}
	*dst = *flag
	return true
}

func (c *serveCmd) Run(g *Globals) error {
	cfg, err := c.settings(g)
	if err != nil {
		return err
	}
	if c.PrintConfig {
		return printConfig(g.stdout, cfg)
	}
	if cfg.CPUProfile != "" {
		stop, err := startCPUProfile(cfg.CPUProfile)
		if err != nil {
			return err
		}
		defer stop()
	}
	cn, err := startCluster(g.Context(), g, &cfg)
	if err != nil {
		return err
	}
	if cn != nil {
		defer cn.Close()
	}
	sc := cfg.storeConfig()
	sc.Logger = g.log
	sc.Cluster = clusterHook(cn)
	sc.Registerer = clusterRegistry(cn)
	st, err := store.New(sc)
	if err != nil {
		return err
	}
	defer st.Close()
	if cn != nil {
		if err := cn.Attach(g.Context(), st); err != nil {
			return fmt.Errorf("serve --cluster: %w", err)
		}
	}

	ctx, cancel := context.WithCancel(g.Context())
	defer cancel()
	if cfg.Metrics != "" {
		stop, err := serveMetrics(ctx, g, metricsAddr(cfg.Metrics), st.MetricsHandler())
		if err != nil {
			return err
		}
		defer stop()
	}
	sock := g.socketPath()
	// The store logs what it serves (backend, capacity) once it has
	// resolved the defaults: no line here repeats the flags unresolved.
	err = st.ListenAndServe(ctx, sock)
	if errors.Is(err, store.ErrDaemonRunning) {
		return reword(err, "serve: a store daemon is already running at %s: use it, stop it first, or pick another --socket", sock)
	}
	if err != nil {
		return fmt.Errorf("serve: on %s: %w", sock, err)
	}
	g.log.Info("store daemon stopped", "socket", sock)
	return nil
}

// startCPUProfile profiles the process's CPU into path until stop.
func startCPUProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("serve experimental-cpu-profile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("serve experimental-cpu-profile: %w", err)
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}

// metricsAddr binds a bare port to loopback: metrics are for the node's
// own scraper unless the user names an interface.
func metricsAddr(a string) string {
	if _, err := strconv.Atoi(a); err == nil {
		return "127.0.0.1:" + a
	}
	if len(a) > 0 && a[0] == ':' {
		return "127.0.0.1" + a
	}
	return a
}

func serveMetrics(ctx context.Context, g *Globals, addr string, h http.Handler) (stop func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("serve: metrics address %s: %w: pick another metrics address", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", h)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			g.log.Error("metrics server failed", "addr", ln.Addr().String(), "err", err)
		}
	}()
	g.log.Info("serving metrics", "url", "http://"+ln.Addr().String()+"/metrics")
	return func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}, nil
}
