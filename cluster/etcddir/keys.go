package etcddir

import (
	"fmt"
	"net/url"
	"strconv"
	"strings"

	"github.com/cudaipc/cudaipc/cluster"
)

// The key layout under Config.Prefix (docs/cluster.md, "Directory keys").
// Object names are path-escaped (url.PathEscape: '/' becomes %2F), so that
// every key splits on '/' unambiguously; versions are 20 digits and shards
// 5, so that keys sort in numeric order.
//
//	node/NODE                                    cluster.Node    node's lease
//	obj/UID/NAME/VERSION/SHARD                   cluster.Object  no lease
//	hold/UID/NAME/VERSION/SHARD/NODE             cluster.Holder  holder's lease
//	latest/UID/NAME                              cluster.Latest  no lease
//	pin/HOLDER/UID/NAME/VERSION/SHARD/READER/ID  cluster.Pin     reader's lease
//	tomb/UID/NAME                                cluster.Tombstone  a tombstone lease
type keys struct{ p string }

func (k keys) node(n string) string { return k.p + "node/" + n }
func (k keys) nodes() string        { return k.p + "node/" }

func refPath(uid uint32, name string) string {
	return strconv.FormatUint(uint64(uid), 10) + "/" + url.PathEscape(name) + "/"
}

func verPath(v uint64, shard uint32) string {
	return fmt.Sprintf("%020d/%05d", v, shard)
}

func (k keys) objects() string                        { return k.p + "obj/" }
func (k keys) objName(uid uint32, name string) string { return k.p + "obj/" + refPath(uid, name) }
func (k keys) obj(r cluster.Ref) string {
	return k.objName(r.Owner, r.Name) + verPath(r.Version, r.Shard)
}
func (k keys) objVersion(uid uint32, name string, v uint64) string {
	return k.objName(uid, name) + fmt.Sprintf("%020d/", v)
}

func (k keys) holders() string                         { return k.p + "hold/" }
func (k keys) holdName(uid uint32, name string) string { return k.p + "hold/" + refPath(uid, name) }
func (k keys) holdRef(r cluster.Ref) string {
	return k.holdName(r.Owner, r.Name) + verPath(r.Version, r.Shard) + "/"
}
func (k keys) hold(r cluster.Ref, node string) string { return k.holdRef(r) + node }
func (k keys) holdVersion(uid uint32, name string, v uint64) string {
	return k.holdName(uid, name) + fmt.Sprintf("%020d/", v)
}

func (k keys) latest(uid uint32, name string) string {
	return k.p + "latest/" + strings.TrimSuffix(refPath(uid, name), "/")
}
func (k keys) latests() string { return k.p + "latest/" }

func (k keys) tomb(uid uint32, name string) string {
	return k.p + "tomb/" + strings.TrimSuffix(refPath(uid, name), "/")
}
func (k keys) tombs() string { return k.p + "tomb/" }

func (k keys) pinsOf(holder string) string { return k.p + "pin/" + holder + "/" }
func (k keys) pinsRef(holder string, r cluster.Ref) string {
	return k.pinsOf(holder) + refPath(r.Owner, r.Name) + verPath(r.Version, r.Shard) + "/"
}
func (k keys) pin(holder string, r cluster.Ref, reader, id string) string {
	return k.pinsRef(holder, r) + reader + "/" + id
}

// parseRef parses "UID/NAME/VERSION/SHARD" (with anything after a further
// '/' returned as rest): the tail of obj/, hold/ and pin/HOLDER/ keys.
func parseRef(s string) (r cluster.Ref, rest string, err error) {
	parts := strings.SplitN(s, "/", 5)
	if len(parts) < 4 {
		return r, "", fmt.Errorf("%w: key tail %q: want UID/NAME/VERSION/SHARD", cluster.ErrBadRecord, s)
	}
	uid, err1 := strconv.ParseUint(parts[0], 10, 32)
	name, err2 := url.PathUnescape(parts[1])
	v, err3 := strconv.ParseUint(parts[2], 10, 64)
	sh, err4 := strconv.ParseUint(parts[3], 10, 32)
	if err1 != nil || err2 != nil || err3 != nil || err4 != nil || name == "" {
		return r, "", fmt.Errorf("%w: key tail %q: want UID/NAME/VERSION/SHARD", cluster.ErrBadRecord, s)
	}
	if len(parts) == 5 {
		rest = parts[4]
	}
	return cluster.Ref{Owner: uint32(uid), Name: name, Version: v, Shard: uint32(sh)}, rest, nil
}
