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

type serveCmd struct {
	Backend      string        `default:"auto" enum:"auto,cuda,host" help:"Memory backend: auto (cuda where the CUDA driver sees a GPU, else host), cuda (GPU objects, named by UUID, and host ones; fails without a GPU) or host."`
	GPUShare     string        `name:"gpu-share" default:"ipc" enum:"ipc,fd" help:"How GPU arenas reach clients: ipc (legacy CUDA IPC, clients in the daemon's PID namespace only) or fd (VMM memory sent as file descriptors: clients in other containers too)."`
	Capacity     bytesize.Size `default:"0" help:"Bytes of memory per device (host, and each GPU) the store may use, e.g. 4GiB (0: 1 GiB)." placeholder:"BYTES"`
	AllowUID     []uint32      `name:"allow-uid" help:"Also admit this uid (repeatable; the daemon's own uid and root are always admitted)." placeholder:"N"`
	AllowGID     []uint32      `name:"allow-gid" help:"Also admit members of this gid (repeatable)." placeholder:"N"`
	Metrics      string        `help:"Serve Prometheus metrics on ADDR at /metrics; a bare port (9464 or :9464) binds loopback only." placeholder:"ADDR"`
	NoEvict      bool          `name:"no-evict" help:"Never evict sealed, unleased objects to make room; creation fails with 'store full' instead."`
	KeepVersions int           `name:"keep-versions" default:"1" help:"Keep this many newest versions of each versioned name without leases (a name may set its own)."`
	MaxObjects   int           `name:"max-objects" default:"0" help:"Most unsealed+sealed objects one client may create (0: default 4096)." placeholder:"N"`
	MaxLeases    int           `name:"max-leases" default:"0" help:"Most leases one client may hold at once (0: default 65536)." placeholder:"N"`
	MaxConns     int           `name:"max-conns" default:"0" help:"Most connections served at once; more get a LIMIT error (0: default 4096, or half the descriptor limit if lower)." placeholder:"N"`
	Quota        bytesize.Size `default:"0" help:"Bytes each uid's objects may take on each device (host, and each GPU); a user's creates evict only that user's objects (0: a fair share, the capacity divided by the uids admitted: all of it when only the daemon's uid uses it)." placeholder:"BYTES"`
	KeepArenas   bytesize.Size `name:"keep-arenas" default:"0" help:"Bytes of empty GPU arenas each GPU keeps for their owner's next objects, so that a put after the last object went costs no allocation or import (0: up to the capacity; they give their room back to any create that needs it)." placeholder:"BYTES"`
	NoKeepArenas bool          `name:"no-keep-arenas" help:"Give empty GPU arenas back at once (see --keep-arenas)."`
	Spin         time.Duration `default:"50us" help:"How long each connection keeps polling for the client's next request before sleeping: a request that comes within it costs no wake-up, at the cost of up to this much CPU per request (0: never poll)." placeholder:"D"`
	MaxConnsUID  int           `name:"max-conns-per-uid" default:"0" help:"Most connections of one uid, root's included (0: default 1024). Uids the daemon does not admit are closed at once and never count." placeholder:"N"`
	MaxObjUID    int           `name:"max-objects-per-uid" default:"0" help:"Most objects of one uid over all its connections: drafts, sealed, and deleted ones still leased (0: default 65536)." placeholder:"N"`
	MaxFDs       int           `name:"max-fds" default:"0" help:"Most descriptors the daemon keeps for objects: two per host arena, one per VMM GPU arena, manifest and registered piece (0: half of what the descriptor limit leaves beside --max-conns)." placeholder:"N"`
	MaxFDsUID    int           `name:"max-fds-per-uid" default:"0" help:"Most descriptors the daemon keeps for one uid's objects (0: a fair share of --max-fds among the uids admitted)." placeholder:"N"`
	CPUProfile   string        `name:"cpu-profile" help:"Write a CPU profile of the daemon, from its start until it stops, to FILE (for 'go tool pprof'): where a node's CPU goes while it serves and pulls." placeholder:"FILE" type:"path"`

	clusterFlags `embed:""` // serve_cluster.go
}

func (c *serveCmd) Help() string {
	return `Runs the object store daemon in the foreground until SIGINT or SIGTERM.

The socket is --socket, else $CUDAIPC_SOCKET, else $XDG_RUNTIME_DIR/cudaipc/store.sock,
else /run/cudaipc/store.sock for root and /tmp/cudaipc-<uid>/store.sock for others.
Only the daemon's uid and root may connect unless --allow-uid/--allow-gid admit others.
Objects are private to their creator's uid unless created shared ('cudaipc put --shared').`
}

func (c *serveCmd) Run(g *Globals) error {
	if c.Capacity < 0 || c.Quota < 0 || c.KeepArenas < 0 || c.MaxObjects < 0 || c.MaxLeases < 0 || c.MaxConns < 0 || c.MaxConnsUID < 0 ||
		c.MaxObjUID < 0 || c.MaxFDs < 0 || c.MaxFDsUID < 0 {
		return errors.New("--capacity, --quota, --keep-arenas, --max-objects, --max-leases, --max-conns, --max-conns-per-uid, --max-objects-per-uid, --max-fds and --max-fds-per-uid must not be negative")
	}
	if c.CPUProfile != "" {
		stop, err := startCPUProfile(c.CPUProfile)
		if err != nil {
			return err
		}
		defer stop()
	}
	cn, err := c.startCluster(g.Context(), g)
	if err != nil {
		return err
	}
	if cn != nil {
		defer cn.Close()
	}
	st, err := store.New(store.Config{
		Backend:             c.Backend,
		GPUShare:            c.GPUShare,
		Capacity:            int64(c.Capacity),
		NoEvict:             c.NoEvict,
		KeepVersions:        c.KeepVersions,
		AllowUIDs:           c.AllowUID,
		AllowGIDs:           c.AllowGID,
		MaxObjectsPerClient: c.MaxObjects,
		MaxLeasesPerClient:  c.MaxLeases,
		MaxConns:            c.MaxConns,
		Quota:               int64(c.Quota),
		KeepArenas:          keepArenas(int64(c.KeepArenas), c.NoKeepArenas),
		MaxConnsPerUID:      c.MaxConnsUID,
		MaxObjectsPerUID:    c.MaxObjUID,
		MaxFDs:              c.MaxFDs,
		MaxFDsPerUID:        c.MaxFDsUID,
		Spin:                spinConfig(c.Spin),
		Logger:              g.log,
		Cluster:             clusterHook(cn),
		Registerer:          clusterRegistry(cn),
	})
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
	if c.Metrics != "" {
		stop, err := serveMetrics(ctx, g, metricsAddr(c.Metrics), st.MetricsHandler())
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
		return nil, fmt.Errorf("serve --cpu-profile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("serve --cpu-profile: %w", err)
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}

// spinConfig maps --spin (0: never poll) to store.Config.Spin (0: the
// default; negative: never).
func spinConfig(d time.Duration) time.Duration {
	if d <= 0 {
		return -1
	}
	return d
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
		return nil, fmt.Errorf("serve: metrics address %s: %w: pick another --metrics address", addr, err)
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

// keepArenas is store.Config.KeepArenas for --keep-arenas and --no-keep-arenas.
func keepArenas(n int64, off bool) int64 {
	if off {
		return -1
	}
	return n
}
