// The console's script (served at /ui/static/console.js). Every page works without it;
// with it: the overview's chart is drawn from /ui/stats, the parts of a page marked
// data-live are replaced from a fresh copy of the page, and a job's output is followed.
"use strict";
(function () {
  var PERIOD = 3000; // milliseconds between updates

  function drawRate(canvas, data) {
    var ctx = canvas.getContext("2d");
    var w = canvas.width, h = canvas.height, pad = 28;
    var n = data.finished.length, top = 1, i;
    for (i = 0; i < n; i++) top = Math.max(top, data.finished[i], data.failed[i]);
    ctx.clearRect(0, 0, w, h);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, w, h);
    ctx.strokeStyle = "#bbb";
    ctx.lineWidth = 1;
    ctx.beginPath();
    ctx.moveTo(pad, 4); ctx.lineTo(pad, h - pad); ctx.lineTo(w - 4, h - pad);
    ctx.stroke();
    ctx.fillStyle = "#555";
    ctx.font = "11px sans-serif";
    ctx.fillText(String(top), 2, 12);
    ctx.fillText("0", 2, h - pad);
    ctx.fillText("-10 min", pad, h - 8);
    ctx.fillText("now", w - 30, h - 8);
    function line(values, colour) {
      ctx.strokeStyle = colour;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      for (var j = 0; j < n; j++) {
        var x = pad + (w - pad - 4) * j / (n - 1);
        var y = h - pad - (h - pad - 6) * values[j] / top;
        if (j === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
      }
      ctx.stroke();
    }
    line(data.finished, "#17762d");
    line(data.failed, "#b00020");
    canvas.dataset.drawn = String(n);
  }

  function chart() {
    var canvas = document.getElementById("rate");
    if (!canvas || !canvas.getContext || !window.fetch) return;
    function update() {
      fetch(canvas.dataset.source, { credentials: "same-origin", cache: "no-store" })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (data) { if (data) drawRate(canvas, data); })
        .catch(function () {});
    }
    update();
    setInterval(update, PERIOD);
  }

  function live() {
    if (!document.querySelector("[data-live]") || !window.fetch || !window.DOMParser) return;
    setInterval(function () {
      fetch(location.href, { credentials: "same-origin", cache: "no-store" })
        .then(function (r) {
          if (r.status === 401) { location.reload(); return null; }
          return r.ok ? r.text() : null;
        })
        .then(function (text) {
          if (!text) return;
          var fresh = new DOMParser().parseFromString(text, "text/html");
          document.querySelectorAll("[data-live][id]").forEach(function (part) {
            var now = fresh.getElementById(part.id);
            if (now && now.innerHTML !== part.innerHTML) part.innerHTML = now.innerHTML;
          });
        })
        .catch(function () {});
    }, PERIOD);
  }

  function follow() {
    var box = document.querySelector(".output[data-follow]");
    if (!box || !window.fetch || !window.TextDecoder) return;
    fetch(box.dataset.follow, { credentials: "same-origin" }).then(function (r) {
      if (!r.ok || !r.body || !r.body.getReader) return;
      var pre = document.createElement("pre");
      pre.className = "live-output";
      var frame = box.querySelector("iframe");
      var reader = r.body.getReader(), decoder = new TextDecoder();
      box.appendChild(pre);
      if (frame) frame.hidden = true;
      function more(step) {
        if (step.done) { pre.dataset.ended = "1"; return; }
        var stuck = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
        pre.appendChild(document.createTextNode(decoder.decode(step.value, { stream: true })));
        if (stuck) pre.scrollTop = pre.scrollHeight;
        return reader.read().then(more);
      }
      return reader.read().then(more);
    }).catch(function () {});
  }

  document.addEventListener("DOMContentLoaded", function () {
    chart();
    live();
    follow();
  });
})();
